"""Vectorized policy sweeps: a grid of policies streamed in ONE jitted, vmapped evaluation.

Policies are data (a pytree of int32 scalars, rsqr_jax.policy), so a batch of them with a leading [P]
axis runs through `engine.stream_nll(..., vmap_policies=True)` under a single compilation: the cache
gets the union capacity of the batch (`CacheSpec.for_policies`) and a leading [P] axis, the weights
are shared (vmapped with in_axes=None: every matmul sees P rows, the weights are read once per step).

    policies, names = policy_grid("mode=rsqr,rerotate,leave_gaps,streamingllm window=128,256 delta=4,8,16")
    nll_PxBxT = sweep_nll(apply_fn, params, tokens_BxT, policies, config=model_config)
    rows = summarize(nll_PxBxT, names)

Sharding (`mesh=`): a `jax.sharding.Mesh` with axes ("policy", "batch") — `make_mesh(n_devices)`.
The vmapped cache is placed with `NamedSharding` on the "policy" axis (and its text-batch axis on
"batch"), the policy batch (a few int32 per policy) and the weights replicated (`PartitionSpec()`: one copy per
device, shared by that device's policies). P is padded up to a multiple of the "policy" axis size with
copies of the last policy and the text batch up to a multiple of the "batch" axis with copies of the
last row; both are stripped from the result. The per-segment NLL is gathered replicated (it is tiny),
so the host can read it on every process.

Across processes (`init_distributed`, then the same code): every process runs the same script with the
same arguments and joins one `jax.distributed` job before anything touches a JAX backend; the mesh is
then built over all global devices, `make_mesh(len(jax.devices()))`, and `sweep_nll(..., mesh=mesh)` runs
unchanged. Every process holds the same host data (grid, tokens, weights), and the placement here uses
`jax.make_array_from_callback`, which only materializes each process's addressable shards, so nothing
host-local needs to change; the NLL is gathered replicated, readable on every process (write the
outputs from `jax.process_index() == 0` only). On CPU the cross-process collectives are gloo's.
`scripts/exp_sweep.py --processes N` runs this with N local processes on a loopback coordinator (tested);
on a cluster, run one process per host.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from rsqr_jax import policy as P
from rsqr_jax.cache import KVCache, init_policy_cache
from rsqr_jax.engine import stream_nll
from rsqr_jax.policy import Policy, PolicyError
from rsqr_jax.spec import CacheSpec, ColdStore

MESH_AXES = ("policy", "batch")

# Grid keys (and their aliases) -> make_policy keyword, in the order the product iterates.
_KEYS = {
    "mode": "mode", "modes": "mode", "policy": "mode",
    "window": "window", "w": "window",
    "sinks": "n_sink", "n_sink": "n_sink", "sink": "n_sink", "n": "n_sink",
    "delta": "delta",
    "max_survivors": "max_survivors", "survivors": "max_survivors", "s": "max_survivors",
    "block": "block", "b": "block",
    "overflow": "overflow",
    "recall_pages": "recall_pages", "recall": "recall_pages",
}
_ORDER = ("mode", "window", "n_sink", "delta", "max_survivors", "block", "overflow", "recall_pages")
_STRING_KEYS = ("mode", "overflow")


def _parse_grid(grid) -> dict[str, list]:
    if isinstance(grid, str):
        items = []
        for tok in grid.replace(";", " ").split():
            key, sep, vals = tok.partition("=")
            if not sep or not key:
                raise PolicyError(f"bad grid term {tok!r}: expected key=v1,v2,...")
            items.append((key, [v for v in vals.split(",") if v != ""]))
    elif isinstance(grid, dict):
        items = [(k, list(v) if isinstance(v, (list, tuple, range)) else [v]) for k, v in grid.items()]
    else:
        raise PolicyError(f"a grid is a string or a dict, got {type(grid).__name__}")
    out: dict[str, list] = {}
    for key, vals in items:
        canon = _KEYS.get(str(key).lower())
        if canon is None:
            raise PolicyError(f"unknown grid key {key!r}: choose from mode, window, sinks, delta, max_survivors, "
                              f"block, overflow, recall_pages")
        if canon in out:
            raise PolicyError(f"grid key {key!r} given twice")
        if not vals:
            raise PolicyError(f"grid key {key!r} has no values")
        if canon not in _STRING_KEYS:
            parsed = []
            for v in vals:
                try:
                    parsed.append(int(v) if isinstance(v, str) else v)
                except ValueError:
                    raise PolicyError(f"{key}: {v!r} is not an integer") from None
            vals = parsed
        else:
            vals = [str(v) for v in vals]
        out[canon] = vals
    if "mode" not in out:
        raise PolicyError(f"the grid needs mode=... (one or more of {', '.join(P.MODES)})")
    return out


def _full_name(h: dict) -> str:
    return (f"{P.MODES[h['mode']]}(W={h['window']}, N={h['n_sink']}, delta={h['delta']}, S={h['max_survivors']}, "
            f"b={h['block']}, {P.OVERFLOWS[h['overflow']]})")


def policy_grid(grid: str | dict) -> tuple[Policy, list[str]]:
    """(Policy batch [P], names) for the cartesian product of a grid, duplicates removed.

    `grid` is "mode=rsqr,rerotate window=128,256 delta=4,8,16" (whitespace-separated key=v1,v2 terms)
    or {"mode": [...], "window": [...], ...}. Keys: mode, window, sinks (n_sink), delta, max_survivors,
    block, overflow; a missing key takes make_policy's default. Modes whose name fixes a parameter
    (full, window, streamingllm) collapse: identical resulting policies are kept once, in first-seen
    order. Names are Policy.name (made fully explicit if two different policies would share one).
    Raises PolicyError (one line) on an unknown key or mode, or an impossible value.
    """
    axes = _parse_grid(grid)
    keys = [k for k in _ORDER if k in axes]
    seen: dict[tuple, int] = {}
    pols, hosts = [], []
    for combo in itertools.product(*(axes[k] for k in keys)):
        kw = dict(zip(keys, combo))
        pol = P.make_policy(kw.pop("mode"), **kw)
        h = pol.host()
        sig = tuple(h.values())
        if sig in seen:
            continue
        seen[sig] = len(pols)
        pols.append(pol)
        hosts.append(h)
    names = [p.name for p in pols]
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    names = [_full_name(h) if counts[n] > 1 else n for n, h in zip(names, hosts)]
    return P.stack_policies(pols), names


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-process JAX job (call before any JAX backend initializes).

    coordinator "host:port" with num_processes / process_id, or all None to let JAX detect the cluster
    (SLURM, Open MPI, Kubernetes, Cloud TPU). CPU devices get gloo collectives (the cross-process
    all-gather of the NLL needs them; the default CPU client has none across processes)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)


def make_mesh(n_devices: int | None = None, *, batch_devices: int = 1, devices=None) -> Mesh:
    """A ("policy", "batch") mesh over the first n_devices devices (default: all of jax.devices())."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else int(n_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"asked for {n} devices, {len(devices)} available")
    if n % batch_devices:
        raise ValueError(f"{n} devices do not split into batch groups of {batch_devices}")
    return Mesh(np.array(devices[:n]).reshape(n // batch_devices, batch_devices), MESH_AXES)


def _cache_partition(cache: KVCache) -> KVCache:
    """PartitionSpec of each leaf of a policy-vmapped cache: [P] on "policy", text batch on "batch"."""
    batch_axis = {"win_k": 2, "win_v": 2, "surv_k": 2, "surv_v": 2, "surv_k_rot": 2, "win_tok": 1, "surv_tok": 1,
                  "loc_k": 2, "loc_v": 2}
    cold_batch_axis = {"k": 2, "v": 2, "sums": 2, "lo": 2, "hi": 2, "scoring": 2}

    def spec_of(x, axis):
        axes = ["policy"] + [None] * (x.ndim - 1)
        if axis is not None:
            axes[axis] = "batch"
        return PS(*axes)

    specs = {f.name: spec_of(getattr(cache, f.name), batch_axis.get(f.name))
             for f in dataclasses.fields(cache) if f.name != "cold"}
    cold = cache.cold
    if cold is not None:
        cold = cold.replace(**{f.name: spec_of(getattr(cold, f.name), cold_batch_axis.get(f.name))
                               for f in dataclasses.fields(cold)
                               if f.name != "page_size" and getattr(cold, f.name) is not None})
    return KVCache(cold=cold, **specs)


def _place(x, sharding: NamedSharding) -> jax.Array:
    """Host value -> global array with `sharding` (each process builds only its addressable shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _n_policies(policies: Policy) -> int:
    n = P.policy_size(policies)
    if n is None:
        raise PolicyError("sweep_nll needs a policy batch with a leading [P] axis (policy_grid / stack_policies)")
    return n


def sweep_nll(apply_fn, params, tokens_BxT, policies: Policy | list[Policy], *, config=None,
              spec: CacheSpec | None = None, dtype: str = "float32", chunk: int = 1, segment: int = 256,
              mesh: Mesh | None = None, progress=None, return_cache: bool = False, cold: ColdStore | None = None):
    """NLL [P, B, T-1] (float32 numpy) of every policy of the batch, streamed in one vmapped evaluation.

    `config` is anything with num_layers / num_kv_heads / head_dim (e.g. a model config); the cache
    spec is the union over the batch (pass `spec` to override). Token t+1 is scored from the logits
    at t, exactly as `stream_nll` does for one policy. With `mesh` (axes "policy", "batch"), the
    policy batch, the vmapped cache and the text batch are sharded and the weights replicated.
    return_cache: also return the final vmapped cache (padded to the mesh, [P_pad, ...]). cold: the
    recall tier's store when a policy of the batch recalls (default ColdStore()).
    """
    if isinstance(policies, (list, tuple)):
        policies = P.stack_policies(list(policies))
    n_pol = _n_policies(policies)
    tokens = np.asarray(tokens_BxT, np.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    B, T = tokens.shape
    if T < 2:
        raise ValueError(f"need at least 2 tokens to score, got {T}")

    n_pdev = n_bdev = 1
    if mesh is not None:
        if tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(f"mesh axes must be {MESH_AXES}, got {mesh.axis_names}")
        n_pdev, n_bdev = mesh.shape["policy"], mesh.shape["batch"]
    P_pad = -(-n_pol // n_pdev) * n_pdev
    B_pad = -(-B // n_bdev) * n_bdev
    if P_pad > n_pol:
        policies = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], P_pad - n_pol, 0)]), policies)
    if B_pad > B:
        tokens = np.concatenate([tokens, np.repeat(tokens[-1:], B_pad - B, 0)])

    if spec is None:
        if config is None:
            raise ValueError("sweep_nll needs config= (num_layers, num_kv_heads, head_dim) or spec=")
        recalls = bool(np.any(np.asarray(policies.recall_pages) > 0))
        spec = CacheSpec.for_policies(policies, dims=config, batch=B_pad, dtype=dtype, max_chunk=chunk, max_len=T,
                                      cold=(cold or ColdStore()) if recalls else None)
    elif spec.batch != B_pad:
        spec = dataclasses.replace(spec, batch=B_pad)

    if mesh is None:
        nll, cache = stream_nll(apply_fn, params, tokens, policies, spec, chunk=chunk, segment=segment,
                                progress=progress, vmap_policies=True)
    else:
        shape = jax.eval_shape(lambda: init_policy_cache(spec, P_pad))
        cache_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), _cache_partition(shape))
        cache = jax.jit(lambda: init_policy_cache(spec, P_pad), out_shardings=cache_sh)()
        # Replicated (P int32 scalars per field, tiny): stream_nll reads the policies on the host
        # (validate), which a policy-sharded array spanning other processes' devices does not allow; each
        # device slices out its own policies next to its policy-sharded cache.
        policies = jax.tree.map(lambda x: _place(x, NamedSharding(mesh, PS())), policies)
        params = jax.tree.map(lambda x: _place(x, NamedSharding(mesh, PS())), params)
        nll, cache = stream_nll(apply_fn, params, tokens, policies, spec, chunk=chunk, segment=segment,
                                progress=progress, vmap_policies=True, cache=cache, cache_sharding=cache_sh)
    nll = np.asarray(nll)[:n_pol, :B]
    return (nll, cache) if return_cache else nll


def summarize(nll_PxBxT, names: list[str], tokens_per_bucket: int = 1000) -> list[dict]:
    """One row per policy: overall perplexity and the perplexity of each bucket of predicted tokens.

    Row keys: name, ppl, nll (mean), tokens (scored per sequence), bucket_end (1-based position of the
    last scored token in each bucket), ppl_curve (perplexity of each bucket, averaged over the batch).
    """
    nll = np.asarray(nll_PxBxT, np.float64)
    if nll.ndim == 2:
        nll = nll[:, None]
    if nll.shape[0] != len(names):
        raise ValueError(f"{nll.shape[0]} policies but {len(names)} names")
    if tokens_per_bucket < 1:
        raise ValueError("tokens_per_bucket must be >= 1")
    n = nll.shape[-1]
    edges = list(range(0, n, tokens_per_bucket)) + [n]
    rows = []
    for i, name in enumerate(names):
        mean = float(nll[i].mean())
        curve = [float(math.exp(nll[i, :, a:b].mean())) for a, b in zip(edges[:-1], edges[1:])]
        rows.append({"name": name, "ppl": float(math.exp(mean)), "nll": mean, "tokens": n,
                     "bucket_end": edges[1:], "ppl_curve": curve})
    return rows
