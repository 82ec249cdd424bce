"""Your model, your loop, meshlm's parallelism: a GPT-2-style model on the embedded corpus.

meshlm launch --nproc-per-node 2 examples/custom_loop.py --layout dp=2 --zero 3
meshlm launch --nproc-per-node 4 examples/custom_loop.py --layout dp=2,tp=2 --zero 1
"""

import argparse

import torch
import torch.nn.functional as F
from gpt2 import GPT2, GPT2_PLAN

import meshlm
from meshlm.config import DataSection
from meshlm.data import GlobalBatchSampler, prepare_data_shared

args = argparse.ArgumentParser()
args.add_argument("--layout", default="")
args.add_argument("--zero", type=int, default=0)
args.add_argument("--max-chars", type=int, help="cap on the corpus (default: all of it, as `make demo` reads it)")
args.add_argument("--steps", type=int, default=20)
args = args.parse_args()

mesh = meshlm.init_mesh(args.layout, device="cpu")
# the demo's corpus and tokenizer (configs/tiny.toml: the standard library, 512 tokens): tokenized once, shared
data = prepare_data_shared(DataSection(max_chars=args.max_chars), vocab_size=512)
torch.manual_seed(0)  # the same initial weights on every rank
model = meshlm.parallelize(GPT2(), mesh, {"zero": args.zero}, plan=GPT2_PLAN, loss=meshlm.Loss(gather_logits=True))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = GlobalBatchSampler(data.train, seq_len=64, global_batch=8, seed=0)

for _ in range(args.steps):
    x, y = batches.next_batch(mesh.rank("dp"), mesh.size("dp"))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.backward(loss)
    model.clip_grad_norm_(1.0)
    model.step(optimizer)

final = model.replica_mean(loss).item()  # collective: every rank
if torch.distributed.get_rank() == 0:
    print(f"final loss {final:.5f}")
meshlm.shutdown()  # barrier + destroy_process_group: a rank exiting with its group alive can abort
