"""Pieces shared by the example scripts: flags, synthetic data, timing and the printed lines."""
import argparse
from typing import Any, Callable, Iterable, List, NamedTuple, Optional

import torch
import torch.nn.functional as F

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


# Optional flags, each shared by several examples: name -> (argparse keyword arguments).
OPTIONAL_FLAGS = {
    "fp32_gate": dict(default=False, action="store_true"),
    "eval": dict(default=False, action="store_true"),
    "use_2dh": dict(default=False, action="store_true"),
    "use_tensorcore": dict(default=False, action="store_true"),
    "allreduce_degree": dict(type=int, default=1, help="-1 disables the gradient all-reduce"),
    "parallel_type": dict(type=str, default="adaptive:1"),
    "checkpoint_path": dict(type=str, default="", help="pattern with {rank} and {size}"),
    "capacity_factor": dict(type=float, default=1.0),
    "megablocks_size": dict(type=int, default=0),
    "expert_type": dict(type=str, default="ffn"),
}


def add_flags(parser: argparse.ArgumentParser, *names: str, **defaults) -> None:
    """Adds the named OPTIONAL_FLAGS (keyword arguments override their defaults)."""
    for name in names:
        options = dict(OPTIONAL_FLAGS[name])
        if name in defaults:
            options["default"] = defaults[name]
        parser.add_argument("--" + name, **options)


def benchmark_line(args, world_size: int, device, parallel_type: Optional[str] = None) -> str:
    """Tutel's ``[Benchmark] ...`` line describing the run."""
    line = ("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
            "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s"
            % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
               args.num_local_experts, args.top, args.a2a_ffn_overlap_degree))
    if parallel_type is not None:
        line += ", parallel_type = `%s`" % parallel_type
    return line + ", device = `%s`" % device


def training_step(model, optimizer, x, y, layer, *, l_aux_wt: float = 0.0, eval_mode: bool = False,
                  shared: Iterable[torch.nn.Parameter] = (), world_size: int = 1) -> Callable[[int], torch.Tensor]:
    """step(i) -> loss: NLL of model(x) against y (+ l_aux_wt * the layer's l_aux), backward, gradient
    averaging of `shared` parameters over the processes, optimizer step (or only the loss with eval_mode)."""
    shared = list(shared)

    def step(_):
        if eval_mode:
            with torch.no_grad():
                return F.nll_loss(model(x), y)
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        if l_aux_wt:
            loss = loss + l_aux_wt * layer.l_aux
        loss.backward()
        average_gradients(shared, world_size)
        optimizer.step()
        return loss

    return step


def tflops_printer(dist_print, args, num_global_experts: int, eval_mode: bool = False,
                   top: Callable[[], int] = None, suffix: Callable[[], str] = lambda: ""):
    """print_step(i, loss, seconds) writing Tutel's ``STEP-i: loss = ..., perf = ... tflops.`` line."""
    def print_step(i, loss, seconds):
        tflops = flops_tflops(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size,
                              top() if top else args.top, num_global_experts, seconds, eval_mode)
        dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops.%s"
                   % (i, loss, seconds, tflops, suffix()))

    return print_step


def parser_for(doc: str, *flags: str, hidden_size: bool = True, **defaults) -> argparse.ArgumentParser:
    """An argument parser with the common flags and the named optional ones (first doc line as description)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_common_flags(parser, hidden_size=hidden_size)
    add_flags(parser, *flags, **defaults)
    return parser


class Run(NamedTuple):
    """What an example needs from its environment."""

    env: Any                  # tutel.system's parallel environment
    dist_print: Callable      # prints on global rank 0 only
    world_size: int
    device: torch.device
    dtype: torch.dtype


def start(args) -> Run:
    """Joins the processes (if launched with torchrun / mpiexec) and resolves device and dtype."""
    env = init_parallel(args.device)
    return Run(env, env.dist_print, env.global_size, env.local_device, DTYPES[args.dtype])


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
