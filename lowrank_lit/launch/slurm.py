"""``lowrank submit``: write an sbatch script for a run (or an offline sweep) and submit it.

Lightning's SLURM model is one task per GPU: ``--ntasks-per-node`` equals ``trainer.devices``,
``--nodes`` equals ``trainer.num_nodes``, and the training command is launched with
``srun --kill-on-bad-exit=1`` (a rank that dies ends the step instead of leaving the others waiting
in a collective). The script asks for ``--signal=SIGUSR1@90`` and ``--requeue``: on SIGUSR1 every
rank stops after the same batch, ``checkpoints/last.ckpt`` is written and the job is requeued
(:class:`~lowrank_lit.callbacks.ResumeCheckpoint`); it comes back with the same job id, hence the
same run directory and W&B run, and resumes from the run's newest checkpoint.

``lowrank submit --sweep sweeps/x.yaml --array K`` submits K workers of ``lowrank sweep`` as one
array job sharing one optuna journal file, so they split the trials.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from time import strftime
from typing import Literal

from jsonargparse.typing import PositiveInt

from lowrank_lit.argtypes import PassThrough, Typed
from lowrank_lit.launch.sweep_study import default_storage, sweep_folder

__all__ = ["render_script", "main"]

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


def _template() -> str:
    return resources.files("lowrank_lit.launch").joinpath("templates/sbatch.sh").read_text()


#: the fragment ``lowrank submit --strategy fsdp`` composes after the run's configs
FSDP_FRAGMENT = Path(__file__).resolve().parents[2] / "configs" / "base" / "trainer_fsdp.yaml"


def render_script(
    *,
    fit_args: list[str] | None = None,
    sweep: str | None = None,
    array: PositiveInt | None = None,
    nodes: int = 1,
    gpus_per_node: int = 1,
    cpus_per_task: PositiveInt = 8,
    time_limit: str = "04:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = "lowrank",
    log_dir: str = "runs/slurm",
    workdir: str | None = None,
    python: str | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    trials_per_task: PositiveInt | None = None,
    accelerator: str = "gpu",
    run_root: str | None = None,
) -> str:
    """The sbatch script text (see the module docstring). ``accelerator="cpu"`` asks for no GPU (no ``--gres``) and
    runs ``gpus_per_node`` CPU processes per node."""
    if accelerator not in ("gpu", "cpu"):
        raise ValueError(f"lowrank submit: --accelerator={accelerator!r}; allowed: gpu, cpu")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"lowrank submit: --nodes={nodes} and --gpus-per-node={gpus_per_node} must be >= 1")
    if not _TIME_RE.match(time_limit):
        raise ValueError(f"lowrank submit: --time={time_limit!r}; allowed: [D-]HH[:MM[:SS]], e.g. 04:00:00 or 1-00:00:00")
    python = python or sys.executable
    extra = []
    if partition:
        extra.append(f"#SBATCH --partition={partition}")
    if account:
        extra.append(f"#SBATCH --account={account}")
    if sweep:
        if array is None or array < 1:
            raise ValueError(f"lowrank submit: --array={array!r}; allowed: an integer >= 1 with --sweep")
        extra.append(f"#SBATCH --array=0-{array - 1}")
        # each array task is one sweep worker on one node; its trials run one after another on its GPUs
        ntasks = 1
        cmd = [python, "-m", "lowrank_lit", "sweep", sweep, "--storage", storage or "", "--study-name",
               study_name or Path(sweep).stem]
        if trials_per_task:
            cmd += ["--n-trials", str(trials_per_task)]
        if run_root:  # the trials' run folders (and the sweep's table) under the same root as the storage
            cmd += ["--run-root", run_root]
        # srun makes the worker a job step: SLURM's signals (the time limit's SIGUSR1) and accounting reach it
        launch = shlex.join(["srun", "--kill-on-bad-exit=1", *cmd]) + ' --seed "$SLURM_ARRAY_TASK_ID"'
        launch += f" --trainer.accelerator={accelerator}"
        if gpus_per_node > 1 or nodes > 1:
            launch += f" --trainer.devices={gpus_per_node} --trainer.num_nodes={nodes}"
    else:
        ntasks = gpus_per_node
        sharded = any(str(a).endswith("trainer_fsdp.yaml") for a in fit_args or [])
        several = nodes * gpus_per_node > 1 or accelerator == "gpu"
        strategy = ["--trainer.strategy=ddp"] if several and not sharded else []
        cmd = ["srun", "--kill-on-bad-exit=1", python, "-m", "lowrank_lit", *(fit_args or []),
               f"--trainer.num_nodes={nodes}", f"--trainer.devices={gpus_per_node}", *strategy,
               f"--trainer.accelerator={accelerator}"]
        launch = shlex.join(cmd)
    return _template().format(
        script="<this file>",
        job_name=job_name,
        nodes=nodes,
        ntasks_per_node=ntasks,
        gres=f"#SBATCH --gres=gpu:{gpus_per_node}\n" if accelerator == "gpu" else "",
        cpus_per_task=cpus_per_task,
        time=time_limit,
        log_dir=log_dir,
        extra_sbatch="\n".join(extra),
        workdir=shlex.quote(workdir or os.getcwd()),
        launch=launch,
    )


def _sweep_configs(sweep: str | None) -> list[str]:
    """The ``--config`` files of a sweep file's command (its trials' base configs)."""
    if not sweep or not Path(sweep).is_file():
        return []
    import yaml

    from lowrank_lit.launch.config_yaml import config_files

    return config_files([str(a) for a in (yaml.safe_load(Path(sweep).read_text()) or {}).get("command") or []])


def _config_accelerator(configs: list[str]) -> str:
    """``cpu`` when the last of ``configs`` that sets ``trainer.accelerator`` says cpu, else ``gpu``."""
    import yaml

    accel = None
    for c in configs:
        try:
            trainer = (yaml.safe_load(Path(c).read_text()) or {}).get("trainer") or {}
        except (OSError, yaml.YAMLError):
            continue
        accel = trainer.get("accelerator", accel)
    return "cpu" if str(accel).lower() == "cpu" else "gpu"


def main(*, config: list[str] | None = None, sweep: str | None = None, array: PositiveInt | None = None,
         trials_per_task: PositiveInt | None = None, storage: str | None = None, study_name: str | None = None, nodes: int = 1,
         gpus_per_node: int = 1, cpus_per_task: PositiveInt = 8, time: str = "04:00:00", partition: str | None = None,  # noqa: A002
         account: str | None = None, job_name: str | None = None, run_root: str = "runs",
         accelerator: Literal["gpu", "cpu"] | None = None, strategy: Literal["ddp", "fsdp"] = "ddp",
         dry_run: bool = False, extra: PassThrough = [],  # noqa: B006
         given: Typed = ()) -> int:
    """Write an sbatch script for a run or for sweep workers and submit it (``--config C.yaml ...`` or
    ``--sweep S.yaml --array K``; flags it does not know, and everything after ``--``, go to ``lowrank fit``).

    Args:
        config: config file(s) for `lowrank fit` (repeatable)
        sweep: submit offline sweep workers for this sweep file instead
        array: number of sweep workers (array tasks)
        trials_per_task: trials per sweep worker
        storage: shared optuna storage (default: runs/sweeps/<study>/study.journal)
        study_name: optuna study / W&B group (default: sweep file stem)
        nodes: nodes (= trainer.num_nodes)
        gpus_per_node: GPUs per node (= trainer.devices = tasks per node)
        cpus_per_task: CPU cores per task (data loading)
        time: wall-time limit, [D-]HH:MM:SS
        partition: SLURM partition
        account: SLURM account
        job_name: job name (default: the experiment or sweep name)
        run_root: run root (default: runs)
        accelerator: what each task runs on (default: the config's trainer.accelerator: cpu asks for no GPU,
            gpu/cuda/auto/unset ask for --gpus-per-node GPUs)
        strategy: ddp (every GPU holds the whole model) or fsdp (configs/base/trainer_fsdp.yaml: parameters,
            gradients and optimizer state sharded over every GPU of every node)
        dry_run: print the script instead of submitting it (nothing is written)
        extra: the flags passed on to `lowrank fit`
        given: the words after `lowrank submit`
    """
    config = config or []
    if strategy == "fsdp":
        if sweep:
            print("lowrank submit: error: --strategy fsdp runs one sharded run (--config); allowed with --sweep: ddp",
                  file=sys.stderr)
            return 2
        config = [*config, str(FSDP_FRAGMENT)]
    if bool(config) == bool(sweep):
        print("lowrank submit: error: pass either --config FILE (a run) or --sweep FILE --array K (sweep workers)",
              file=sys.stderr)
        return 2
    from lowrank_lit.launch.config_yaml import experiment_from_configs

    if sweep:
        name = study_name or Path(sweep).stem
        folder = sweep_folder(run_root, name)
        storage = storage or str(default_storage(run_root, name))
    else:
        missing = [c for c in config if not Path(c).is_file()]
        if missing:
            print(f"lowrank submit: error: --config file {missing[0]!r} does not exist", file=sys.stderr)
            return 2
        name = experiment_from_configs(config)
        folder = Path(run_root) / name
        storage = None
    configs = config or _sweep_configs(sweep)
    accelerator = accelerator or _config_accelerator(configs)
    log_dir = (folder / "slurm").resolve()  # SLURM opens the --output file before the script runs: made below
    if accelerator == "cpu" and any(w.startswith(("--gpus-per-node", "--gpus_per_node")) for w in given) \
            and gpus_per_node > 1:
        print(f"lowrank submit: note: the config runs on the CPU (trainer.accelerator: cpu), so the job asks for no GPU "
              f"and runs {gpus_per_node} CPU processes per node; --accelerator gpu asks for "
              f"{gpus_per_node} GPUs per node", file=sys.stderr)
    fit_args = ["fit", *[a for c in config for a in ("--config", c)], "--run_root", run_root, *extra]
    try:
        script = render_script(
            fit_args=fit_args, sweep=sweep, array=array, nodes=nodes, gpus_per_node=gpus_per_node,
            cpus_per_task=cpus_per_task, time_limit=time, partition=partition, account=account,
            job_name=job_name or name.replace("/", "-"), log_dir=str(log_dir), storage=storage,
            study_name=study_name or (Path(sweep).stem if sweep else None),
            trials_per_task=trials_per_task, accelerator=accelerator,
            run_root=run_root if sweep else None,
        )
    except ValueError as exc:  # refused before anything is written
        print(f"{str(exc).replace('lowrank submit: ', 'lowrank submit: error: ', 1)}", file=sys.stderr)
        return 2
    if sweep and extra:
        script = script.rstrip("\n") + " " + shlex.join(extra) + "\n"
    if dry_run:
        print(script, end="")
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print("lowrank submit: error: `sbatch` not found on PATH (not on a SLURM login node?); "
              "use --dry-run to print the script", file=sys.stderr)
        return 2
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script.replace("<this file>", str(path)))
    out = subprocess.run([sbatch, str(path)], capture_output=True, text=True, check=False)
    print(out.stdout.strip() or out.stderr.strip())
    print(f"script: {path}")
    return out.returncode
