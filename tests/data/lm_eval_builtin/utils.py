"""Loads this directory's JSON data (make_data.py) as a datasets.DatasetDict: the data source that
builtin.yaml gives lm-eval's own lambada_openai and wikitext tasks instead of the hub (offline, any cwd)."""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    import datasets

    with open(os.path.join(HERE, name)) as f:
        splits = json.load(f)
    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def load_lambada(**_):
    return _load("lambada.json")


def load_wikitext(**_):
    return _load("wikitext.json")
