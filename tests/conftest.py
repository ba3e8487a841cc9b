import torch

# Tests run tiny models: one thread is as fast, and it does not oversubscribe a busy 2-core machine.
torch.set_num_threads(1)
