"""Slurm batch scripts: reading, writing, submitting.

``submit`` writes the batch script that runs ``corral run`` inside the
allocation (the nodes are then reached with srun job steps:
``corral.transport.srun``), hands it to ``sbatch`` and follows the job from
the queue to its output and exit code, as an attended run is followed.
Everything goes through Slurm's own commands (sbatch, squeue, scontrol,
scancel), so whatever ``SLURM_CONF`` and the user's Slurm set-up say holds.
"""
