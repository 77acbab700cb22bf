"""Find which use of cuVS brute_force crashes the process: each step runs in its own interpreter (faulthandler on)
and reports ok, an exception or the signal it died of.

    python3 scripts/lab/cuvs_probe.py            # every step
    python3 scripts/lab/cuvs_probe.py --step 3   # one step, in this process
"""
import argparse
import subprocess
import sys

STEPS = {
    1: "default resources, 10k x 64 items, 100 queries, k=10",
    2: "default resources, 1M x 64 items, 8192 queries, k=100",
    3: "Resources(stream=cupy stream), 1M items, 8192 queries, k=100",
    4: "default resources with preallocated neighbors (int64) and distances",
    5: "bench CuvsContender, 10k items, 1000 users, k=100",
    6: "bench CuvsContender, 1M items, 100k users, k=100",
}


def step(n: int) -> None:
    import cupy as cp
    from cuvs.common import Resources
    from cuvs.neighbors import brute_force

    rng = cp.random.default_rng(0)
    if n in (1, 5):
        items, users, k = 10_000, (100 if n == 1 else 1000), (10 if n == 1 else 100)
    else:
        items, users, k = 1_000_000, (8192 if n < 6 else 100_000), 100
    xb = rng.standard_normal((items, 64), dtype=cp.float32)
    xq = rng.standard_normal((users, 64), dtype=cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    if n in (1, 2):
        index = brute_force.build(xb, metric="inner_product")
        d, i = brute_force.search(index, xq, k)
        print(cp.asarray(i)[:1, :3])
    elif n in (3, 4):
        s = cp.cuda.Stream(non_blocking=True)
        res = Resources(stream=s.ptr) if n == 3 else Resources()
        index = brute_force.build(xb, metric="inner_product", resources=res)
        res.sync()
        if n == 3:
            d, i = brute_force.search(index, xq, k, resources=res)
        else:
            D = cp.empty((users, k), cp.float32)
            I = cp.empty((users, k), cp.int64)
            brute_force.search(index, xq, k, neighbors=I, distances=D, resources=res)
            i = I
        res.sync()
        print(cp.asarray(i)[:1, :3])
    else:
        from recall.bench.contenders import CuvsContender

        c = CuvsContender("gpu", "ip")
        c.prepare(xb)
        I, D = c.search(xq, k)
        c.sync()
        print(I[:1, :3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int)
    a = ap.parse_args()
    if a.step:
        step(a.step)
        return
    for n, what in STEPS.items():
        r = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--step", str(n)], capture_output=True,
                           text=True, timeout=120)
        verdict = "ok" if r.returncode == 0 else f"rc {r.returncode}"
        print(f"step {n} ({what}): {verdict}")
        if r.returncode:
            print("   " + "\n   ".join((r.stdout + r.stderr).strip().splitlines()[-14:]))


if __name__ == "__main__":
    main()
