"""A runtime job whose rank 0 raises after its last step (a final save that fails), for the end-of-job tests.

Usage: python fail_after_loop.py STEPS GATE. Before its last step, active rank 0 opens the FIFO GATE
and waits there until the test writes to it (no sleeps: the test decides when the job may end).
"""

import sys

import torch

import tmrun

run = tmrun.init()
model = torch.nn.Linear(4, 1)
run.track(model=model)
total = int(sys.argv[1])
for step in run.steps(total=total):
    if step == total - 1 and run.rank == 0 and run.role == "active":
        open(sys.argv[2]).close()  # blocks until the test opens the FIFO for writing
    model(torch.ones(4)).sum().backward()
    run.commit()
if run.rank == 0 and run.role == "active":
    raise OSError(28, "No space left on device", "final.pt")
run.finish()
