"""Start-up time of the look-around commands, as ratios to importing torch and Lightning (same run).

    python benchmarks/cli_startup.py [--repeats 5]

Each command is a fresh process (what a user waits for), timed wall-clock, repeats interleaved so
machine noise hits all alike; the table shows the median seconds and the ratio to importing torch.
Target: `lowrank list`, `lowrank list --markdown`, `lowrank fit --config missing.yaml` and
`lowrank sweep <file> --check` answer in under 1.5 s, i.e. well below one torch import; they import
neither torch, Lightning nor any method module; `lowrank list` <= 0.35x `import lightning`. `lowrank fit --help` is
built once (Lightning and every method imported) and then read from a cache: the cached call <= 3 s; the first call
is timed with an empty cache each time. `lowrank fit --config ... --print_config` is the reference for a command that
does need Lightning.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "python -c 'import lightning'": [sys.executable, "-c", "import lightning"],
    "lowrank list": [sys.executable, "-m", "lowrank_lit", "list"],
    "lowrank list --markdown": [sys.executable, "-m", "lowrank_lit", "list", "--markdown"],
    "lowrank fit --config missing.yaml": [sys.executable, "-m", "lowrank_lit", "fit", "--config", "missing.yaml"],
    "lowrank sweep sweeps/q3r.yaml --check": [sys.executable, "-m", "lowrank_lit", "sweep", "sweeps/q3r.yaml", "--check"],
    "lowrank fit --help (cached)": [sys.executable, "-m", "lowrank_lit", "fit", "--help"],
    "lowrank fit --help (first call)": [sys.executable, "-m", "lowrank_lit", "fit", "--help"],
    "lowrank fit ... --print_config": [sys.executable, "-m", "lowrank_lit", "fit", "--config",
                                       "configs/baseline/mlp_digits.yaml", "--print_config"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (median reported)")
    opts = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cache = tempfile.mkdtemp(prefix="lowrank_help_")
    subprocess.run(COMMANDS["lowrank fit --help (cached)"], cwd=ROOT, capture_output=True, check=False,
                   env={**os.environ, "LOWRANK_CACHE_DIR": cache})  # warm the cache the "(cached)" row reads
    for _ in range(opts.repeats):
        for name, cmd in COMMANDS.items():
            env = {**os.environ, "LOWRANK_CACHE_DIR": tempfile.mkdtemp() if "first call" in name else cache}
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False, env=env)
            times[name].append(time.perf_counter() - start)
    torch_s = statistics.median(times["python -c 'import torch'"])
    lightning_s = statistics.median(times["python -c 'import lightning'"])
    print("| command | median s | / import torch | / import lightning |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| `{name}` | {med:.2f} | {med / torch_s:.2f}x | {med / lightning_s:.2f}x |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
