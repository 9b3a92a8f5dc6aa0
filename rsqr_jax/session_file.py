"""The session file format: a numpy .npz archive (never pickled), written atomically, read back verified.

The archive holds:

* ``header``: UTF-8 JSON: format name and version, the caller's model identity, the CacheSpec, the
  policy values, the sampler settings (``sampling``: rsqr_jax.sampling.Sampling.to_json(), with
  ``max_candidates`` and ``seed``), eos ids, the pending token, the
  caller's ``extra`` dict (e.g. a chat transcript), the name/dtype/shape of every array, and a
  SHA-256 checksum over the header (without the checksum) and every array's name, dtype, shape, bytes;
* one entry per array (every KVCache field, the rng key, and ``recent``: the ring of the last
  repeat_last_n token ids fed), stored as its raw bytes (so bfloat16
  and any other dtype round-trip exactly).

Writes are atomic: a temporary file in the target directory, fsync, then os.replace, so a crash
leaves either the old file or the new one, never a half-written one. Anything that does not read
back as exactly what it claims to be (truncated, corrupted, another format version, saved for another
model identity) raises SessionFileError with a one-line message. Module-level functions, so tests can
craft files that are well-formed but wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import tempfile

import jax.numpy as jnp
import numpy as np

from rsqr_jax.policy import Policy

FORMAT = "rsqr_jax.session"
FORMAT_VERSION = 4  # one current format: a file of another version is refused with one line


class SessionFileError(ValueError):
    """A session file that cannot be written, or cannot be read back as exactly the session it claims to be."""


def _one_line(e: BaseException | str) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _json_clean(obj, what: str):
    """obj after a JSON round trip (what the file will hold); ValueError if it is not JSON-serializable."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable: {_one_line(e)}") from None


def check_identity(name, saved: dict, identity: dict) -> None:
    """SessionFileError (one line, naming the differing keys) unless a file's saved identity equals `identity`."""
    want = _json_clean(identity, "identity")
    if not isinstance(saved, dict) or saved != want:
        saved = saved if isinstance(saved, dict) else {}
        diff = [f"{k}: {saved.get(k)!r} != {want.get(k)!r}"
                for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]
        raise SessionFileError(f"{os.fspath(name)} was saved for another model ({'; '.join(diff)})")


def _checksum(header: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    body = {k: v for k, v in header.items() if k != "checksum"}
    h.update(json.dumps(body, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.name}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_session_file(path: str | os.PathLike, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Atomically write header (completed with array metadata and checksum) + arrays; SessionFileError on failure."""
    path = os.fspath(path)
    header = _json_clean(header, "header")  # exactly what the file will hold (and what load re-checksums)
    header["arrays"] = {k: {"dtype": np.asarray(a).dtype.name, "shape": list(np.shape(a))} for k, a in arrays.items()}
    header["checksum"] = _checksum(header, arrays)
    payload = {"header": np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)}
    for k, a in arrays.items():
        payload[f"a/{k}"] = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SessionFileError(f"cannot write session file {path}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise SessionFileError(f"cannot write session file {path}: {e.strerror or _one_line(e)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise SessionFileError(f"cannot write session file {path}: {e.strerror or _one_line(e)}") from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_session_file(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a session file, checked for format, version and checksum; SessionFileError otherwise."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise SessionFileError(f"session file not found: {name}") from None
    except OSError as e:
        raise SessionFileError(f"cannot read session file {name}: {e.strerror or _one_line(e)}") from None
    if not raw.startswith(b"PK\x03\x04"):
        raise SessionFileError(f"{name} is not a session file (not an .npz archive{'; empty' if not raw else ''})")
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            entries = {k: np.asarray(z[k]) for k in z.files}
        header = json.loads(entries.pop("header").tobytes().decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except Exception as e:  # zipfile / numpy / json raise many types on truncated or corrupt input
        raise SessionFileError(f"{name} is not a readable session file (truncated or corrupt: {_one_line(e)})") \
            from None
    if header.get("format") != FORMAT:
        raise SessionFileError(f"{name} is not an {FORMAT} file")
    if header.get("version") != FORMAT_VERSION:
        raise SessionFileError(f"{name} has session format version {header.get('version')!r}; this code reads "
                               f"version {FORMAT_VERSION}")
    try:
        meta = header["arrays"]
        if set(meta) != {k[2:] for k in entries if k.startswith("a/")} or len(meta) != len(entries):
            raise ValueError("array list does not match the archive")
        arrays = {}
        for k, m in meta.items():
            dt = jnp.dtype(m["dtype"])
            shape = tuple(int(s) for s in m["shape"])
            buf = entries[f"a/{k}"]
            if buf.dtype != np.uint8 or buf.size != dt.itemsize * math.prod(shape):
                raise ValueError(f"array {k} has {buf.size} bytes, expected {dt}{list(shape)}")
            arrays[k] = buf.view(dt).reshape(shape)
    except Exception as e:
        raise SessionFileError(f"{name} is corrupt: {_one_line(e)}") from None
    if header.get("checksum") != _checksum(header, arrays):
        raise SessionFileError(f"{name} is corrupt: checksum mismatch")
    _check_header_fields(name, header)
    return header, arrays


_INT = (int,)
_HEADER_FIELDS = {"identity": (dict,), "extra": (dict,), "spec": (dict,), "policy": (dict,), "prefill_chunk": _INT,
                  "sampling": (dict,), "max_candidates": _INT, "seed": _INT, "eos_ids": (list,),
                  "vocab_size": _INT + (type(None),), "pending": _INT + (type(None),), "n_tokens": _INT,
                  "cold_slots_saved": _INT}


def _check_header_fields(name: str, header: dict) -> None:
    """The header has every field a Session needs, of the right JSON type (so readers can index it safely)."""
    from rsqr_jax.policy import MODES, OVERFLOWS

    for key, types in _HEADER_FIELDS.items():
        v = header.get(key)
        if key not in header or not isinstance(v, types) or isinstance(v, bool):
            raise SessionFileError(f"{name} has a malformed header: field {key!r} = {v!r}")
    pol = header["policy"]
    if (not all(isinstance(pol.get(f.name), int) for f in dataclasses.fields(Policy))
            or not 0 <= pol["mode"] < len(MODES) or not 0 <= pol["overflow"] < len(OVERFLOWS)):
        raise SessionFileError(f"{name} has a malformed header: policy {pol!r}")
