"""Instructions of the float16 fused kernels' epilogue, counted in their machine code (SASS) without a GPU: the
Hopper module built with nvcc for sm_90a as ``build_kernels.py`` builds it, each build option given, disassembled
with nvdisasm (``pip download --no-deps nvidia-cuda-nvdisasm``: its wheel holds ``nvidia/cu13/bin/nvdisasm``).

For each ``recall_fused_filter_wN`` it reports the instructions a warp runs for one group of scores of a user
(fused_w.cu's RW_GROUP, 16; ``--defines=-DRW_GROUP=8`` for another) after the tile's products
(``recall_append_group``): the group's maximum and its test, then, where the group holds a survivor, the
survivors' bits (up to the survivors' loop; a whole tile's path), and each round of that loop (a survivor its
user's stage in shared memory holds). Static counts along those paths of the tile's first group: what
the warp issues when it takes them, not a timing.

    python3 scripts/lab/sass_epilogue.py --nvdisasm /path/to/nvdisasm [--defines=-DRH_EACH_SCORE] [--ks 2]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_kernels import build  # noqa: E402  (the same nvcc build as the build check)
from recall.backends.cupy import kernels  # noqa: E402

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def function(sass: str, name: str) -> list[tuple[str, str]]:
    """(kind, text) lines of one kernel: ("label", name) or ("op", instruction)."""
    out, inside = [], False
    for line in sass.splitlines():
        if line.startswith(".text."):
            inside = line.strip() == f".text.{name}:"
            continue
        if not inside:
            continue
        m = LABEL.match(line.strip())
        if m:
            out.append(("label", m.group(1)))
            continue
        m = INSTR.search(line)
        if m:
            out.append(("op", m.group(2).strip()))
    return out


def walk(lines: list[tuple[str, str]], labels: dict, start: int, stop: int) -> int:
    """Instructions run from ``start`` up to ``stop`` (an index), every forward branch to a label before ``stop``
    taken: the path of a whole tile (a branch past the last tile's rows) and of a survivor its user's stage holds
    (a branch past the global atomic's path)."""
    n, i = 0, start
    while i < stop:
        kind, text = lines[i]
        if kind == "op":
            n += 1
            m = BRANCH.search(text)
            if m and i < labels.get(m.group(1), -1) <= stop:
                i = labels[m.group(1)]
                continue
        i += 1
    return n


def epilogue(lines: list[tuple[str, str]]) -> dict:
    """The first group's paths after the tile's products (the first WARPGROUP.DEPBAR): its maximum and test, its
    survivors' bits (to the survivors' loop), and a round of that loop (the first branch back after the test)."""
    start = next(i for i, (k, t) in enumerate(lines) if k == "op" and t.startswith("WARPGROUP.DEPBAR"))
    test = next(i for i in range(start, len(lines)) if lines[i][0] == "op" and BRANCH.search(lines[i][1]))
    labels = {t: i for i, (k, t) in enumerate(lines) if k == "label"}
    back = next(i for i in range(test + 1, len(lines)) if lines[i][0] == "op" and (m := BRANCH.search(lines[i][1]))
                and test < labels.get(m.group(1), -1) < i)
    top = labels[BRANCH.search(lines[back][1]).group(1)]
    return {"max_and_test": walk(lines, labels, start + 1, test + 1), "bits": walk(lines, labels, test + 1, top),
            "round": walk(lines, labels, top, back + 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc"))
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--defines", action="append", default=[], help="a build option; repeat for several builds")
    ap.add_argument("--ks", type=int, action="append", default=[], help="kernels recall_fused_filter_wKS (2)")
    a = ap.parse_args()
    if not (a.nvcc and a.nvdisasm):
        print("needs nvcc and nvdisasm (give --nvcc, --nvdisasm)")
        return 1
    print("| build | kernel | max and test | survivors' bits | a survivor's round |")
    print("| --- | --- | ---: | ---: | ---: |")
    for defines in ["", *a.defines]:
        with tempfile.TemporaryDirectory() as tmp:
            rc, log = build(a.nvcc, kernels.HOPPER_FUSED_SOURCES, "sm_90a", tuple(defines.split()), Path(tmp))
            if rc:
                print(log[-3000:])
                return 1
            sass = subprocess.run([a.nvdisasm, "-c", str(Path(tmp) / "module.cubin")], capture_output=True,
                                  text=True, check=True).stdout
        for ks in a.ks or [2]:
            e = epilogue(function(sass, f"recall_fused_filter_w{ks}"))
            print(f"| {defines or 'shipped'} | w{ks} | {e['max_and_test']} | {e['bits']} | {e['round']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
