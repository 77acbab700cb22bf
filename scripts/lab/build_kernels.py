"""Every CUDA module of the GPU backend, shipped and with each measurement-only build option, compiled with nvcc
for the architecture it runs on (sm_90; sm_90a for fused_w.cu's wgmma kernels), with each kernel's registers and
spills: a check that kernel code builds, for a machine with the CUDA toolkit and no GPU. The run-time build is
NVRTC's through CuPy (``recall.backends.cupy.kernels``), with the same sources in the same order; nvcc's front end
is the same compiler's, so that what fails here fails there.

    python3 scripts/lab/build_kernels.py [--only fused_w] [--nvcc /usr/local/bin/nvcc] [--json out.json]

Exits 1 if a build fails.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from recall.backends.cupy import kernels

# (name, sources, architecture, options): the modules kernels.py builds, then the measurement-only builds.
BUILDS = (
    ("selection", kernels.SELECTION_SOURCES, "sm_90", ()),
    ("selection RECALL_SEED_BISECT", kernels.SELECTION_SOURCES, "sm_90", ("-DRECALL_SEED_BISECT",)),
    ("selection RH_EACH_SCORE", kernels.SELECTION_SOURCES, "sm_90", ("-DRH_EACH_SCORE",)),
    ("selection RECALL_MERGE_BITWISE", kernels.SELECTION_SOURCES, "sm_90", ("-DRECALL_MERGE_BITWISE",)),
    ("selection RECALL_MERGE_NO_STREAM", kernels.SELECTION_SOURCES, "sm_90", ("-DRECALL_MERGE_NO_STREAM",)),
    ("fused_w", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ()),
    ("fused_w RW_DIRECT_APPEND", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRW_DIRECT_APPEND",)),
    ("fused_w RW_SBO_PAD", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRW_SBO_PAD=16",)),
    ("fused_w RW_A_REGS", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRW_A_REGS=1",)),
    ("fused_w RS_NO_KEEP", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRS_NO_KEEP",)),
    ("fused_w RS_KEPT=16", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRS_KEPT=16",)),
    ("fused_w RS_PUSH", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRS_PUSH",)),
    ("fused_w RW_STAGE32", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRW_STAGE32",)),
    ("fused_w RW_GROUP=8", kernels.HOPPER_FUSED_SOURCES, "sm_90a", ("-DRW_GROUP=8",)),
    ("fused_w RH_BITS_SET RH_GROUP_RESERVE", kernels.HOPPER_FUSED_SOURCES, "sm_90a",
     ("-DRH_BITS_SET", "-DRH_GROUP_RESERVE")),
    ("selection RH_BITS_SET RH_GROUP_RESERVE", kernels.SELECTION_SOURCES, "sm_90",
     ("-DRH_BITS_SET", "-DRH_GROUP_RESERVE")),
    ("walk_w", kernels.HOPPER_WALK_SOURCES, "sm_90a", ()),
    ("walk_w RK_COUNT", kernels.HOPPER_WALK_SOURCES, "sm_90a", ("-DRK_COUNT",)),
    ("walk_w RK_NO_TAKE", kernels.HOPPER_WALK_SOURCES, "sm_90a", ("-DRK_NO_TAKE",)),
    ("walk_w RK_SKIP_COMPACT", kernels.HOPPER_WALK_SOURCES, "sm_90a", ("-DRK_SKIP_COMPACT",)),
    ("fast16", ("fast16.cu",), "sm_90", ("--fmad=false",)),
    ("rescore", ("rescore.cu",), "sm_90", ()),
    ("rescore RS_ORD_WHOLE_PIECES", ("rescore.cu",), "sm_90", ("-DRS_ORD_WHOLE_PIECES",)),
    ("norms", ("norms.cu",), "sm_90", ()),
)


# Templated kernels, which NVRTC instantiates by name at run time (rescore.py): instantiated here so that ptxas
# compiles them (the warp re-scoring and the ordered block kernel over float4 rows).
INSTANTIATE = {"rescore.cu": (
    "template __global__ void recall_rescore_warp_t<1>(const float*, const float*, int, const long long*,"
    " const long long*, int, int, float*, long long*);\n"
    "template __global__ void recall_rescore_warp_t<0>(const float*, const float*, int, const long long*,"
    " const long long*, int, int, float*, long long*);\n"
    "template __global__ void recall_rescore_t<2, 2, 1, 1>(const float*, const float*, int, const float*,"
    " const long long*, const long long*, int, int, int, int, float*, long long*);\n")}


def build(nvcc: str, sources: tuple[str, ...], arch: str, options: tuple[str, ...], work: Path) -> tuple[int, str]:
    src = work / "module.cu"
    src.write_text("".join(kernels.source(n) for n in sources) + "".join(INSTANTIATE.get(n, "") for n in sources))
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++14", "-ftz=true", "-Xptxas", "-v", *options, str(src),
           "-o", str(work / "module.cubin")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def kernels_of(log: str) -> dict[str, dict]:
    """{kernel: {registers, spill_stores, spill_loads}} from ptxas -v's report."""
    out: dict[str, dict] = {}
    name = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            out[name] = {}
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            out[name].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name]["registers"] = int(m.group(1))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvcc", default=shutil.which("nvcc"))
    p.add_argument("--only", default="", help="builds whose name contains this")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if not a.nvcc:
        print("no nvcc on PATH (give --nvcc)")
        return 1
    failed, results = [], []
    print("| build | kernels | most registers | spilling kernels |")
    print("| --- | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, sources, arch, options in BUILDS:
            if a.only not in name:
                continue
            rc, log = build(a.nvcc, sources, arch, options, Path(tmp))
            if rc:
                failed.append(name)
                print(f"| {name} | FAILED | | |\n{log[-4000:]}")
                continue
            ks = kernels_of(log)
            spilling = [k for k, v in ks.items() if v.get("spill_stores") or v.get("spill_loads")]
            print(f"| {name} | {len(ks)} | {max((v.get('registers', 0) for v in ks.values()), default=0)} | "
                  f"{', '.join(spilling) or 'none'} |", flush=True)
            results.append({"build": name, "arch": arch, "options": list(options), "kernels": ks})
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
