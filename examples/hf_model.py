"""A Hugging Face LlamaForCausalLM object (random weights, built from a config) under dp × tp.

    meshlm launch --nproc-per-node 4 examples/hf_model.py --layout dp=2,tp=2

meshlm's plan for the HF decoder families (Llama, Qwen2, Mistral) splits the model in place; the loss is
meshlm's vocabulary-parallel cross-entropy of `output.logits`, so the logits are never gathered.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshlm
from meshlm.config import DataSection
from meshlm.data import GlobalBatchSampler, prepare_data_shared

args = argparse.ArgumentParser()
args.add_argument("--layout", default="")
args.add_argument("--zero", type=int, default=0)
args.add_argument("--max-chars", type=int, help="cap on the corpus (default: all of it, as `make demo` reads it)")
args.add_argument("--steps", type=int, default=10)
args = args.parse_args()

mesh = meshlm.init_mesh(args.layout, device="cpu")
# the demo's corpus and tokenizer (configs/tiny.toml: the standard library, 512 tokens): tokenized once, shared
data = prepare_data_shared(DataSection(max_chars=args.max_chars), vocab_size=512)
config = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
torch.manual_seed(0)
model = meshlm.parallelize(LlamaForCausalLM(config), mesh, {"zero": args.zero})
optimizer = torch.optim.AdamW(model.optimizer_param_groups(weight_decay=0.1), lr=3e-3)
batches = GlobalBatchSampler(data.train, seq_len=64, global_batch=8, seed=0)

for _ in range(args.steps):
    x, y = batches.next_batch(mesh.rank("dp"), mesh.size("dp"))
    loss = model.loss_fn(model(x), y)  # vocabulary-parallel under tp
    model.backward(loss)
    model.clip_grad_norm_(1.0)
    model.step(optimizer)

final = model.replica_mean(loss).item()  # collective: every rank
if torch.distributed.get_rank() == 0:
    print(f"final loss {final:.6g}")
meshlm.shutdown()  # barrier + destroy_process_group: a rank exiting with its group alive can abort
