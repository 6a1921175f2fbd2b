"""Start-up time of the look-around commands, as ratios to ``python -c "import torch"`` (same run).

    python benchmarks/cli_startup.py [--repeats 5]

Each command is a fresh process (what a user waits for), timed wall-clock, repeats interleaved so
machine noise hits all alike; the table shows the median seconds and the ratio to importing torch.
Target: `lowrank list`, `lowrank list --markdown`, `lowrank fit --config missing.yaml` and
`lowrank sweep <file> --check` answer in under 1.5 s, i.e. well below one torch import; they import
neither torch, Lightning nor any method module. `lowrank fit --config ... --print_config` is the
reference for a command that does need Lightning.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "lowrank list": [sys.executable, "-m", "lowrank_lit", "list"],
    "lowrank list --markdown": [sys.executable, "-m", "lowrank_lit", "list", "--markdown"],
    "lowrank fit --config missing.yaml": [sys.executable, "-m", "lowrank_lit", "fit", "--config", "missing.yaml"],
    "lowrank sweep sweeps/q3r.yaml --check": [sys.executable, "-m", "lowrank_lit", "sweep", "sweeps/q3r.yaml", "--check"],
    "lowrank fit ... --print_config": [sys.executable, "-m", "lowrank_lit", "fit", "--config",
                                       "configs/baseline/mlp_digits.yaml", "--print_config"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (median reported)")
    opts = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(opts.repeats):
        for name, cmd in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["python -c 'import torch'"])
    print("| command | median s | / import torch |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| `{name}` | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
