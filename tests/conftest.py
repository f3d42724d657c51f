"""Test-session settings: torch on one intra-op thread. The models here are tiny, so extra
threads only add barrier waits — which explode on a loaded 2-core box (measured: 6 ms vs
300+ ms per decode step)."""
import torch

torch.set_num_threads(1)
