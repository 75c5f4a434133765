"""The Slurm job-array recipe for a run split with `generate --shard i/N`: one array task per shard, then a job
that depends on the whole array and merges the shards. docs/scaling.md shows these texts verbatim and
tests/generation/runners/test_slurm_array.py runs them as the array would (SLURM_ARRAY_TASK_ID set, one process
each), so the recipe users copy is the one tested. No scheduler is needed to read or run them.
"""

# sbatch exports the submitting shell's environment (PATH with medbanana, SOURCES, RUNS, the API key) to the jobs.
SHARDS_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=medbanana-shards
#SBATCH --array=0-3
#SBATCH --cpus-per-task=2
#SBATCH --requeue
# One shard per array task; a requeued or resubmitted task resumes from its shard's journal.
N=4  # shards: keep equal to the size of --array above (0 to N-1)
medbanana generate --sources "$SOURCES" --out "$RUNS/shard-$SLURM_ARRAY_TASK_ID-of-$N" \\
    --shard "$SLURM_ARRAY_TASK_ID/$N" --backend gemini --seed 0 -q
"""

MERGE_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=medbanana-merge
medbanana merge "$RUNS"/shard-*-of-* --out "$RUNS/merged"
"""

SUBMIT = """\
export SOURCES=/shared/sources RUNS=/shared/runs   # storage every node sees
shards=$(sbatch --parsable medbanana-shards.sbatch)
sbatch --dependency=afterok:$shards medbanana-merge.sbatch
"""
