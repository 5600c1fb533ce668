"""Repository-wide pytest setup.

The test models are tiny: torch's intra-op threads only add spin-wait overhead there (and
collapse when other processes share the 2 cores), so tests run single-threaded."""

import torch

torch.set_num_threads(1)
