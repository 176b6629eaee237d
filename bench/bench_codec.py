"""The persistent level's codec (``Checkpointer(codec=)``, issue #58): ratio, compress and
decompress rates of byte shuffle + zstd on two trained states, and the time to durable on an
S3 level (a loopback moto server) with and without it.

States: the demo's (``cryosnap demo``: embedding + SparseAdam + Adam, trained ``--demo-steps``
steps) and a transformers GPT-2 (``--layers`` x ``--width``, vocabulary 8000, initialized from
its config: nothing is downloaded) trained ``--gpt-steps`` steps with AdamW on random tokens.
Each state is saved plain with cryosnap; its data files are then coded as the flush codes
them (storage/_codec.py's CodedWriter, frames of 4 MiB) and read back through DecodedStore:
the ratio is plain bytes over stored bytes, the rates plain MB per second of the codec alone
(one thread; medians of ``--repeat``). Time to durable: ``save(step, state).result()`` of the
GPT-2 state with the persistent level on moto (``--level s3``) or a local directory
(``--level local``), reached by the flush from scratch on a local directory (``--route
flush``) or written directly, without scratch (``--route direct``: the write path codes on the
writer's I/O thread), codec None, "zstd" and "auto" (three runs open at once, saves
alternated, ``--repeat`` + 1 full versions each, the first left out: "auto" calibrates on
it), and the rates "auto" measured. ``--durable-only`` skips the states' rates.

Run: ``.venv/bin/python bench/bench_codec.py --repeat 3``, or
``.venv/bin/python bench/bench_codec.py --repeat 3 --durable-only --route direct --level local``
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import _harness as h
import cryosnap
from cryosnap.storage import CodedWriter, LocalStore, decoded


def demo_state(steps: int) -> dict[str, Any]:
    from cryosnap.demo import _training

    parts = _training.build()
    _training.train(parts, 0, steps, lambda step: None)
    return {k: parts[k].state_dict() for k in ("model", "sparse", "dense")}


def gpt_state(layers: int, width: int, steps: int, seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=8000, n_positions=128, n_embd=width, n_layer=layers, n_head=max(1, width // 64)
    )
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, 8000, (8, 128))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def codec_rates(state: dict[str, Any], repeat: int) -> dict[str, float]:
    """Ratio and rates of the codec over the data files cryosnap writes for ``state``."""
    with tempfile.TemporaryDirectory() as d:
        cryosnap.save(f"{d}/plain", state, step=1)
        plain = LocalStore(Path(d, "plain"))
        coded = LocalStore(Path(d, "coded"))
        keys = plain.list("data")
        datas = {k: plain.read(k) for k in keys}
        encode, decode, stored = [], [], 0
        for _ in range(repeat):
            t, stored = 0.0, 0
            for k, data in datas.items():
                writer = CodedWriter(coded.open_writer(k))
                writer.write([memoryview(data)])
                writer.commit()
                t += writer.stats.encode_seconds
                stored += writer.stats.stored_bytes
            encode.append(t)
            view = decoded(coded, keys)
            back = {k: memoryview(bytearray(len(v))) for k, v in datas.items()}
            t0 = time.perf_counter()
            for k in keys:
                view.read_into(k, 0, [back[k]])
            decode.append(time.perf_counter() - t0)
            assert all(back[k] == datas[k] for k in keys)
        nbytes = sum(len(v) for v in datas.values())
    return {
        "plain_mb": nbytes / 1e6,
        "stored_mb": stored / 1e6,
        "ratio": nbytes / stored,
        "compress_mb_s": nbytes / statistics.median(encode) / 1e6,
        "decompress_mb_s": nbytes / statistics.median(decode) / 1e6,
    }


def _moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(200):
        try:
            opener.open(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto did not start")


def durable_seconds(
    layers: int, width: int, steps: int, repeat: int, *, route: str = "flush", level: str = "s3"
) -> dict[str, Any]:
    """Seconds from save() to durable on the persistent level (``level``: "s3" on moto, or
    "local", a directory), reached by ``route`` ("flush" from scratch, or "direct"): codec
    None, "zstd" and "auto", three runs open at once, their saves alternated; each run's
    first version (auto's calibration) is left out of the medians."""
    import contextlib

    proc: subprocess.Popen[bytes] | None = None
    options: dict[str, Any] | None = None
    if level == "s3":
        import s3fs

        proc, endpoint = _moto()
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="bench")
    codecs = ("none", "zstd", "auto")
    out: dict[str, list[float]] = {c: [] for c in codecs}
    result: dict[str, Any] = {}
    try:
        states = [gpt_state(layers, width, steps, seed) for seed in range(repeat + 1)]
        with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
            where = {
                c: f"s3://bench/{c}" if level == "s3" else f"{d}/persistent-{c}" for c in codecs
            }
            runs = {
                c: stack.enter_context(
                    cryosnap.Checkpointer(
                        where[c],
                        scratch=f"{d}/{c}" if route == "flush" else None,
                        storage_options=options,
                        codec=None if c == "none" else c,
                        incremental=False,
                        keep=1,
                    )
                )
                for c in codecs
            }
            for i, state in enumerate(states):
                for c in codecs:
                    t0 = time.perf_counter()
                    runs[c].save(i + 1, state).result()
                    if i:
                        out[c].append(time.perf_counter() - t0)
            for c in ("zstd", "auto"):
                codec = runs[c]._levels.levels[-1].codec
                assert codec is not None
                rates = codec.snapshot()
                result[f"rates_{c}"] = {
                    "level_mb_s": (rates.write_bytes_per_s or 0) / 1e6,
                    "codec_mb_s": (rates.codec_bytes_per_s or 0) / 1e6,
                    "ratio": rates.ratio,
                    "coded_files": rates.coded_files,
                    "plain_files": rates.plain_files,
                }
            stack.close()  # retention done: one version each
            for c in codecs:
                result[f"stored_mb_{c}"] = _stored_bytes(where[c], options) / 1e6
                result[f"durable_s_{c}"] = statistics.median(out[c])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    return result


def _stored_bytes(url: str, options: dict[str, Any] | None) -> int:
    """The bytes of a run's data files on its persistent level (objects or files)."""
    if options is not None:
        import s3fs

        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        return int(sum(fs.du(f"{url.removeprefix('s3://')}/data", total=False).values()))
    return sum(f.stat().st_size for f in Path(url, "data").iterdir())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--demo-steps", type=int, default=64)
    p.add_argument("--gpt-steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.add_argument("--route", choices=("flush", "direct"), default="flush")
    p.add_argument("--level", choices=("s3", "local"), default="s3")
    p.add_argument("--durable-only", action="store_true", help="skip the states' rates")
    a = p.parse_args()
    before = h.load_average()
    result: dict[str, Any] = {}
    if not a.durable_only:
        result["demo"] = codec_rates(demo_state(a.demo_steps), a.repeat)
        result["gpt2_adamw"] = codec_rates(gpt_state(a.layers, a.width, a.gpt_steps), a.repeat)
    result["durable"] = durable_seconds(
        a.layers, a.width, a.gpt_steps, a.repeat, route=a.route, level=a.level
    )
    result["durable"].update(route=a.route, level=a.level)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    h.print_load(before)
    for name in ("demo", "gpt2_adamw") if not a.durable_only else ():
        r = result[name]
        print(
            f"{name:11s} {r['plain_mb']:8.1f} MB -> {r['stored_mb']:8.1f} MB  ratio "
            f"{r['ratio']:.3f}  compress {r['compress_mb_s']:6.0f} MB/s  decompress "
            f"{r['decompress_mb_s']:6.0f} MB/s"
        )
    s = result["durable"]
    for c in ("none", "zstd", "auto"):
        print(
            f"{a.level} level, {a.route} route: time to durable, codec={c}: "
            f"{s[f'durable_s_{c}']:.2f} s ({s[f'stored_mb_{c}']:.1f} MB stored)"
        )
    for c in ("zstd", "auto"):
        print(f"  {c} measured: {s[f'rates_{c}']}")


if __name__ == "__main__":
    main()
