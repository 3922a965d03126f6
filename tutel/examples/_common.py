"""Pieces shared by the example scripts: flags, synthetic data, timing and the printed lines."""
import argparse
from typing import Callable, Iterable, List, Optional

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_common_flags(parser: argparse.ArgumentParser, *, hidden_size: bool = True) -> None:
    """Flags every helloworld-style example accepts (Tutel's names and defaults)."""
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_tokens", type=int, default=512)
    parser.add_argument("--model_dim", type=int, default=2048)
    if hidden_size:
        parser.add_argument("--hidden_size", type=int, default=2048)
    parser.add_argument("--num_local_experts", type=int, default=2)
    parser.add_argument("--dtype", type=str, default="float32", choices=sorted(DTYPES))
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--l_aux_wt", type=float, default=0.0)
    parser.add_argument("--a2a_ffn_overlap_degree", type=int, default=1)
    parser.add_argument("--num_steps", type=int, default=100)
    parser.add_argument("--device", type=str, default=default_device(), choices=["cpu", "cuda"])


def init_parallel(device: str):
    """torch.distributed (when launched with torchrun or mpiexec) or a single process."""
    from tutel import system
    return system.init_data_model_parallel(backend="nccl" if device == "cuda" else "gloo")


def synthetic_inputs(batch_size: int, num_tokens: int, model_dim: int, dtype: torch.dtype, device):
    """The helloworld batch: N(0, 1) tokens drawn on the CPU with seed 0, and all-zero labels."""
    torch.manual_seed(0)
    x = torch.randn([batch_size, num_tokens, model_dim], dtype=torch.float32, device="cpu")
    x = x.to(device=device, dtype=dtype)
    labels = torch.zeros(batch_size, dtype=torch.long, device=device)
    return x, labels


def average_gradients(params: Iterable[torch.nn.Parameter], world_size: int, group=None) -> None:
    """Data-parallel averaging of the gradients of shared (non-expert) parameters."""
    if world_size <= 1:
        return
    from tutel import net
    for param in params:
        if param.grad is not None:
            param.grad = net.simple_all_reduce(param.grad / world_size, group=group)


def shared_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Parameters replicated on every process (those not marked as expert parameters)."""
    return [p for p in model.parameters()
            if p.requires_grad and not hasattr(p, "skip_allreduce") and not getattr(p, "_tutel_expert", False)]


def flops_tflops(batch_size, num_tokens, model_dim, hidden_size, top, num_global_experts, seconds, eval_mode):
    """Tutel's nominal expert TFLOP/s: 4 * tokens * M * H per active expert, x3 when training."""
    factor = 1 if eval_mode else 3
    work = batch_size * num_tokens * model_dim * hidden_size * 4 * factor * min(top, num_global_experts)
    return work * 1e-12 / max(seconds, 1e-12)


class StepTimes:
    """Collects step times; the summary averages the last (up to) 10 steps."""

    def __init__(self):
        self.times: List[float] = []

    def add(self, seconds: float) -> None:
        self.times.append(seconds)

    def summary_line(self) -> str:
        tail = self.times[-10:]
        average = sum(tail) / max(len(tail), 1)
        return "\n[Summary] Average synchronized step_time = %s sec." % average


def train_steps(num_steps: int, step: Callable[[int], torch.Tensor], record_time: Callable[[], float],
                print_step: Callable[[int, float, float], None]) -> StepTimes:
    """Runs `step(i)` (returns the loss) num_steps times, printing each step via print_step."""
    times = StepTimes()
    for i in range(num_steps):
        start = record_time()
        loss = step(i)
        stop = record_time()
        times.add(stop - start)
        print_step(i, float(loss.detach()), stop - start)
    return times


def make_record_time(device: str) -> Callable[[], float]:
    from tutel import system
    return lambda: system.record_time(is_cuda=device == "cuda")


def checkpoint_file(pattern: str, rank: int, size: int) -> Optional[str]:
    if not pattern:
        return None
    from tutel import system
    return system.apply_rank_size_from_pattern(pattern, rank=rank, size=size)
