# The step between the quick start and the paper: a GPT-2-small-sized model on the first 10 FineWeb-Edu shards, on
# one GPU. Put it after any variant file,
#   python prepare.py --train_shards 10 && python train.py configs/dyn_exo.py configs/small.py
# 12 layers of width 768 and 12 heads (GPT-2 small's shape; 158M parameters as Dynamic E-ExoFormer, 77M of them the
# embedding and lm_head), the paper's 2048-token windows and 262,144-token steps. 3,600 steps read 944M tokens, less
# than the 10 shards hold (about 100M each), so no batch repeats. The README gives its FLOPs and GPU time; the batch
# (train.py's default 8, 16 micro-steps on one GPU) fits 40 GB by docs/MEMORY.md.
n_layer = 12
n_embd = 768
n_head = 12
max_steps = 3600
# the paper's warmup is 1000 of its 38,147 steps (2.6%): the same share of 3,600
warmup_steps = 94
# its own folder, so that it leaves the quick start's out/ckpt.pt alone
out_dir = "out/small"
