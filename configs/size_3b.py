# The widths, depths and heads of Pythia-2.8B (Biderman et al., 2023, Table 1: 32 layers, d_model 2560, 32 heads),
# for any variant: put it after the variant file,
#   torchrun --nproc_per_node=8 train.py configs/dyn_exo.py configs/size_3b.py --fsdp=True
# 2.56B parameters as Gated Attention, 2.59B as Dynamic E-ExoFormer (the MLP here is SwiGLU of width 2C where
# Pythia's is a GELU of 4C; the anchor projection adds |mix|·C² once). docs/MEMORY.md: what fits which GPU.
n_layer = 32
n_embd = 2560
n_head = 32
