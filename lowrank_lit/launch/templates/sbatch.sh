#!/bin/bash
# Written by `lowrank submit`; edit freely and submit with: sbatch {script}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={ntasks_per_node}
{gres}#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --time={time}
#SBATCH --signal=SIGUSR1@90
#SBATCH --requeue
#SBATCH --output={log_dir}/%x-%j.out
{extra_sbatch}
# On SIGUSR1 (90 s before the time limit) every rank stops at the next batch boundary, checkpoints/last.ckpt is
# written once and the job is requeued; it re-enters runs/<experiment>/<SLURM_JOB_ID>/ and resumes from it.
set -euo pipefail
cd {workdir}
export PYTHONUNBUFFERED=1   # progress lines reach the log as they are printed (one per epoch: stdout is a file)
# since Slurm 22.05 srun does not inherit --cpus-per-task: without this every rank gets one core for its data loaders
if [ -n "${{SLURM_CPUS_PER_TASK:-}}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
{launch}
