"""Encode and decode rates of the erasure-coding libraries ``partner="rs:K+M"`` could use
(issue #58): zfec and pyeclib (over liberasurecode; its ISA-L backend where installed), and
numpy's XOR (what ``partner="xor"`` does) for M = 1, on one core of this machine.

Each codes ``--mib`` MiB of random bytes cut into K segments: encode makes the M parity
segments; decode rebuilds the data from K surviving segments with the first M data segments
lost (the worst case: every lost segment is data). zfec also codes one parity block alone
(what each of the M parity holders of a set computes in cryosnap's layout). Rates are MiB
of data per second, medians of ``--repeat`` runs. Nothing is asserted; libraries not
installed are skipped.

Run: ``.venv/bin/python bench/bench_erasure.py --k 4 --m 2 --mib 64 --repeat 3``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_zfec(segments: list[bytes], k: int, m: int, repeat: int) -> dict[str, float]:
    import zfec

    enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    parity = enc.encode(segments, list(range(k, k + m)))
    survivors = [*segments[m:], *parity][:k]
    nums = [*range(m, k), *range(k, k + m)][:k]
    assert [bytes(b) for b in dec.decode(survivors, nums)] == segments
    return {
        "encode": _time(lambda: enc.encode(segments, list(range(k, k + m))), repeat),
        "decode": _time(lambda: dec.decode(survivors, nums), repeat),
        # What one parity holder of the RS layout computes: its own block only.
        "encode_one": _time(lambda: enc.encode(segments, [k]), repeat),
    }


def bench_pyeclib(
    data: bytes, k: int, m: int, repeat: int, ec_type: str
) -> dict[str, float] | None:
    try:
        from pyeclib.ec_iface import ECDriver

        driver = ECDriver(k=k, m=m, ec_type=ec_type)
    except Exception:  # a backend this liberasurecode lacks
        return None
    fragments = driver.encode(data)
    survivors = fragments[m:]
    assert driver.decode(survivors) == data
    return {
        "encode": _time(lambda: driver.encode(data), repeat),
        "decode": _time(lambda: driver.decode(survivors), repeat),
    }


def bench_xor(segments: list[bytes], repeat: int) -> dict[str, float]:
    arrays = [np.frombuffer(s, np.uint8) for s in segments]

    def xor() -> np.ndarray[Any, np.dtype[np.uint8]]:
        acc = arrays[0].copy()
        for a in arrays[1:]:
            np.bitwise_xor(acc, a, out=acc)
        return acc

    t = _time(xor, repeat)
    return {"encode": t, "decode": t}  # decoding is the same XOR over the survivors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    k, m = args.k, args.m
    seg = (args.mib << 20) // k
    data = np.random.default_rng(0).integers(0, 256, seg * k, np.uint8).tobytes()
    segments = [data[i * seg : (i + 1) * seg] for i in range(k)]
    results: dict[str, dict[str, float] | None] = {}
    try:
        results["zfec"] = bench_zfec(segments, k, m, args.repeat)
    except ImportError:
        results["zfec"] = None
    for ec_type in ("isa_l_rs_vand", "liberasurecode_rs_vand"):
        try:
            results[f"pyeclib:{ec_type}"] = bench_pyeclib(data, k, m, args.repeat, ec_type)
        except ImportError:
            results[f"pyeclib:{ec_type}"] = None
    xor_k = k + m - 1  # the XOR set of as many nodes: k + m - 1 data segments, 1 parity
    xor_seg = (args.mib << 20) // xor_k
    results["numpy-xor (M=1)"] = bench_xor(
        [data[i * xor_seg : (i + 1) * xor_seg] for i in range(xor_k)], args.repeat
    )
    rows = []
    for name, r in results.items():
        if r is None:
            print(f"{name:32} not installed")
            continue
        enc, dec = args.mib / r["encode"], args.mib / r["decode"]
        row = {"library": name, "encode_mib_s": round(enc), "decode_mib_s": round(dec)}
        line = f"{name:32} encode {enc:8.0f} MiB/s   decode {dec:8.0f} MiB/s"
        if "encode_one" in r:
            row["encode_one_block_mib_s"] = round(args.mib / r["encode_one"])
            line += f"   one parity block {row['encode_one_block_mib_s']:8} MiB/s"
        rows.append(row)
        print(line)
    print(json.dumps({"k": k, "m": m, "mib": args.mib, "results": rows}))


if __name__ == "__main__":
    main()
