"""The data source that builtin.yaml gives lm-eval's own lambada_openai and wikitext tasks instead of the
hub (offline, any cwd): a datasets.DatasetDict built at load time by make_data.py from the licence texts
the package ships verbatim (rsqr_jax/data/licenses; deterministic, seed 15). Built at load time, not stored:
those texts may be copied only verbatim, and the passages are cut from them."""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _dataset(splits: dict):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def _make_data():
    """make_data.py, loaded by path (lm-eval imports this file by path, so it is not a package)."""
    spec = importlib.util.spec_from_file_location("lm_eval_builtin_make_data", os.path.join(HERE, "make_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_lambada(**_):
    return _dataset({"test": _make_data().passages()})


def load_wikitext(**_):
    return _dataset(_make_data().documents())
