"""The tools beyond the card, each run from the repository's root as a module (`python -m tools.sweep ...`):
analyze (the paper's analyses), bench (speed and memory, side by side), convert (checkpoints in and out, the Hugging
Face export), sweep (variants x seeds, and their report), launch (torchrun, whose status is 75 after a stop), and
train.sbatch (train.py as a Slurm job)."""
