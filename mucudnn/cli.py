"""The ``mucudnn`` command line. Every command has ``--help``; errors print one line and exit 2."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import click

from ._version import __version__
from .engines import API_CHOICES
from .errors import MucudnnError, UnwritableError
from .policy import POLICIES as POLICY_NAMES
from .sizes import parse_size
from .cli_offload import offload_plan
from .cli_store import store_group, store_option

POLICIES = click.Choice(POLICY_NAMES)
APIS = click.Choice(API_CHOICES)


class SizeParam(click.ParamType):
    """A byte size: 64MiB, 1GiB, 1048576."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except MucudnnError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeParam()


class Group(click.Group):
    """Turns mucudnn's own errors into one clear line and exit status 2, and Ctrl-C into one line
    and exit status 130 (128 + SIGINT, as shells report it)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MucudnnError as exc:
            click.echo(f"mucudnn: error: {exc}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("mucudnn: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="mucudnn")
def main() -> None:
    """Micro-batched cuDNN convolutions: fast algorithms under a workspace limit.

    Typical use: `mucudnn autotune -- python train.py`, or step by step: `mucudnn bench
    resnet50` on the GPU, then `mucudnn tune resnet50 -o r50.plan` (each kernel's fastest plans
    from any workspace down to the smallest; --workspace-limit 64MiB for one plan within it),
    `mucudnn show r50.plan`, and `mucudnn run --plan r50.plan -- python train.py`.
    """


def _unwritable_output(path) -> str | None:
    """Why a file cannot be written at ``path`` (as far as access(2) tells), else None."""
    parent = Path(path).expanduser().absolute().parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is read-only"
    return None


def _check_output(path, what: str = "plan") -> None:
    """Refuse an output nobody could write before spending time on it."""
    reason = _unwritable_output(path)
    if reason:
        raise UnwritableError(f"cannot write {what} {path}: {reason}")


def _write_plan_file(plan, path) -> None:
    """:func:`~mucudnn.plan.write_plan`, with a refusal as one line naming the path and why."""
    from .plan import write_plan
    try:
        write_plan(plan, path)
    except OSError as exc:
        raise UnwritableError(f"cannot write plan {path}: "
                              f"{_unwritable_output(path) or exc.strerror}") from None


def _echo_warnings(source) -> None:
    for text in source.warnings:
        click.echo(f"mucudnn: warning: {text}", err=True)


def _kernels(config: str | None, recordings: tuple[str, ...]):
    from .config import find_config, load_config
    from .plan import read_recording_weights
    if bool(config) == bool(recordings):
        raise MucudnnError("give either a CONFIG or --recording FILE (not both)")
    if config:
        return load_config(find_config(config))
    kernels = read_recording_weights(recordings)
    if not kernels:
        raise MucudnnError(f"{', '.join(recordings)}: no kernels recorded (did the command run "
                           "any cuDNN convolution under 'mucudnn record'?)")
    return kernels


def _inputs(config: str | None, recordings, store_path) -> list[tuple[str, object]]:
    """(what, path) of every file a command reads, for :func:`refuse_inputs_as_output`."""
    from .config import find_config
    from .store import default_store_path
    found = [("benchmark store", store_path or default_store_path())]
    if config:
        found.append(("config", find_config(config)))
    found += [("recording", path) for path in recordings]
    return found


def _optimize(*args, **kwargs):
    """tuner.optimize, each of its warnings about the measurements printed as one line."""
    from .tuner import FitSizesMissingWarning, UntimedOverLimitWarning, optimize
    said = (FitSizesMissingWarning, UntimedOverLimitWarning)
    with warnings.catch_warnings(record=True) as caught:
        for category in said:
            warnings.simplefilter("always", category)
        plan = optimize(*args, **kwargs)
    for warning in caught:
        if issubclass(warning.category, said):
            click.echo(f"mucudnn: warning: {warning.message}", err=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno)
    return plan


@main.command()
@click.argument("config", required=False)
@click.option("--recording", "recordings", multiple=True, type=click.Path(exists=True),
              help="benchmark the kernels a `mucudnn record` run wrote (repeatable)")
@click.option("--policy", type=POLICIES, default="powerOfTwo", show_default=True,
              help="micro-batch sizes to measure (fit: powerOfTwo plus each configuration's "
                   "largest size within --workspace-limit)")
@click.option("--workspace-limit", type=SIZE,
              help="configurations needing more are not timed (plans within it are unchanged; "
                   "bench again without it before tuning for more); policy fit: the limit it "
                   "measures sizes for")
@click.option("--borrow-output", is_flag=True,
              help="for `tune --borrow-output`: pieces may use the output after them, so time "
                   "what fits there too (policy fit: also the sizes of such pieces)")
@click.option("--quick", is_flag=True,
              help="time sizes largest first and skip, per kernel, the smaller ones that cannot "
                   "beat them if per-sample time never improves as micro-batches shrink "
                   "(the usual case, not guaranteed); plans within --workspace-limit only")
@click.option("--api", type=APIS, default="both", show_default=True,
              help="time cuDNN's legacy algorithms, the graph API's engine configurations "
                   "(those its heuristics propose), or both")
@click.option("--remeasure", is_flag=True, help="measure again what the store already has")
@click.option("--no-prune", is_flag=True,
              help="time every configuration fully, also those over 2x slower than one with "
                   "no more workspace (never in a plan; by default timed once)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@click.option("--gpus", default="all", show_default=True, metavar="all|0,1,...",
              help="GPUs to measure on (numbers as CuPy counts the visible ones): with several, "
                   "one worker process per GPU, the kernels split among those of one model, "
                   "every model measuring every kernel, all into the one store")
@store_option
def bench(config, recordings, policy, workspace_limit, borrow_output, quick, api, remeasure,
          no_prune, no_progress, gpus, store_path):
    """Benchmark every algorithm of the kernels of CONFIG (a name like resnet50, or a YAML path)
    or of --recording files at each micro-batch size of the policy, into the store.

    On several GPUs (all visible ones by default) the kernels are spread over one worker process
    per GPU; a worker that fails loses at most the kernel it was measuring (each kernel's rows are
    stored at once) and the bench then fails, saying which GPU, after the others finish."""
    from .timing import TimingMethod
    from .tuner import as_kernels, benchmark
    if policy == "fit" and workspace_limit is None:
        raise click.UsageError("--policy fit needs --workspace-limit (the sizes that fit it)")
    if borrow_output and workspace_limit is None:
        raise click.UsageError("--borrow-output goes with --workspace-limit")
    if quick and workspace_limit is None:
        raise click.UsageError("--quick skips the sizes that cannot help plans within a limit: "
                               "give --workspace-limit")
    if quick and policy == "fit":
        raise click.UsageError("--quick skips sizes; policy fit needs every power of two: "
                               "give one of them")
    source = _kernels(config, recordings)
    method = TimingMethod(dominated_factor=None) if no_prune else TimingMethod()
    timed = benchmark(source, policy, store=store_path, remeasure=remeasure,
                      progress=not no_progress, method=method, api=api,
                      workspace_limit=workspace_limit, borrow_output=borrow_output, quick=quick,
                      gpus=gpus)
    name = getattr(source, "name", "recording")
    click.echo(f"{name}: {len(as_kernels(source))} kernels, measured {timed} kernel sizes "
               f"({'all reused from the store' if timed == 0 else 'stored'})")


@main.command()
@click.argument("config", required=False)
@click.option("--recording", "recordings", multiple=True, type=click.Path(exists=True),
              help="tune the kernels a `mucudnn record` run wrote (repeatable)")
@click.option("--workspace-limit", type=SIZE,
              help="WR: each kernel within this workspace (with --front: the front's cap)")
@click.option("--total-workspace", type=SIZE, help="WD: all kernels together within this budget")
@click.option("--front", is_flag=True,
              help="a front plan (the default with no limit) cut at --workspace-limit")
@click.option("--policy", type=POLICIES, default="powerOfTwo", show_default=True)
@click.option("--precise", is_flag=True,
              help="no FFT/Winograd algorithms (fp32 results stay near GEMM accuracy)")
@click.option("--deterministic", is_flag=True,
              help="deterministic pieces only: plans the shim also runs for callers that chose "
                   "a deterministic algorithm (torch.backends.cudnn.deterministic)")
@click.option("--borrow-output", is_flag=True,
              help="WR: forward and backward-data pieces may use the part of their output that "
                   "later pieces write as workspace (faster under a tight limit, no more memory)")
@click.option("--exclude-algo", "exclude", multiple=True, metavar="NAME",
              help="never use this algorithm or engine configuration (repeatable), e.g. "
                   "fft_tiling or eng0")
@click.option("--api", type=APIS, default="both", show_default=True,
              help="pieces from legacy algorithms only, graph-API engine configurations only, "
                   "or both (every stored row)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="plan file to write")
@click.option("--gpu", help="GPU name of the measurements to use, with --cudnn (default: this "
                            "GPU, or the store's only one)")
@click.option("--cudnn", "cudnn_version", type=int,
              help="cuDNN version of the measurements, with --gpu (e.g. 91900)")
@store_option
def tune(config, recordings, workspace_limit, total_workspace, front, policy, precise,
         deterministic, borrow_output, exclude, api, output, gpu, cudnn_version, store_path):
    """Compute the fastest micro-batch plans of each kernel and write a plan file.

    With no limit: a front plan, each kernel's fastest plans from any workspace down to the
    smallest (the shim runs, per call, the fastest that fits the workspace the call has)."""
    from .environment import Environment
    from .outputs import PLAN, refuse_inputs_as_output, refuse_other_kind
    from .report import SUM_LABEL, describe_math
    from .tuner import (as_kernels, check_excluded_names, open_measurements,
                        predicted_network_time, sum_of_kernel_times)
    if workspace_limit is not None and total_workspace is not None:
        raise click.UsageError("give at most one of --workspace-limit and --total-workspace")
    if (gpu is None) != (cudnn_version is None):
        raise click.UsageError("--gpu and --cudnn go together")
    _check_front_options(workspace_limit, total_workspace, front, borrow_output)
    _check_output(output)
    check_excluded_names(exclude)
    refuse_inputs_as_output(output, _inputs(config, recordings, store_path))
    refuse_other_kind(output, PLAN)
    source = _kernels(config, recordings)
    env = Environment(gpu, cudnn_version) if gpu else None
    store, env = open_measurements(store_path, env)
    with store:
        _echo_warnings(store)
        plan = _optimize(source, workspace_limit=workspace_limit,
                        total_workspace=total_workspace, policy=policy, store=store, env=env,
                        exclude=exclude, precise=precise, api=api, borrow_output=borrow_output,
                        deterministic=deterministic, front=front)
    _write_plan_file(plan, output)
    kernels = as_kernels(source)
    pass_name = ("per step (each kernel x its recorded calls per step)" if recordings
                 else "per pass (each kernel x the layers that run it)")
    click.echo(f"wrote {output}: {_plan_summary(plan)}, predicted "
               f"{predicted_network_time(plan, kernels):.3f} ms {pass_name}, measurements of "
               f"{env.gpu} / cuDNN {env.cudnn}")
    if plan.is_front:
        click.echo(f"fastest points: {SUM_LABEL} {sum_of_kernel_times(plan):.3f} ms; smallest "
                   f"points: {SUM_LABEL} {sum_of_kernel_times(plan, smallest=True):.3f} ms "
                   "(as `mucudnn show`)")
    else:
        click.echo(f"{SUM_LABEL}: plan {sum_of_kernel_times(plan):.3f} ms (as `mucudnn show`)")
    click.echo(describe_math(plan))
    click.echo(f"{store.describe(used=True)} (used by the plan)")


def _check_front_options(workspace_limit, total_workspace, front, borrow_output) -> None:
    """Usage errors of --front and of --borrow-output, which makes WR plans only."""
    if front and total_workspace is not None:
        raise click.UsageError("--front goes with --workspace-limit (its cap), not --total-workspace")
    if borrow_output and (front or workspace_limit is None):
        raise click.UsageError("--borrow-output makes WR plans: give --workspace-limit, without "
                               "--front")


def _plan_summary(plan) -> str:
    """``N kernels (M micro-batched)``; for a front plan ``N kernels, P points (M with
    micro-batched points)``."""
    divided = sum(1 for key, n in plan.kernels() if any(e.is_divided for e in plan.front(key, n)))
    if plan.is_front:
        return (f"{len(plan.kernels())} kernels, {len(plan)} points ({divided} with micro-batched "
                "points)")
    return f"{len(plan)} kernels ({divided} micro-batched)"


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@store_option
def show(plan_path, store_path):
    """Print PLAN as a table: micro-batches, algorithms, workspace, predicted time, and speedups
    over the best undivided algorithm within the same limit and over uncapped cuDNN."""
    from .environment import Environment
    from .plan import read_plan, read_restrictions
    from .report import format_plan_table, plan_rows
    from .tuner import open_measurements
    plan = read_plan(plan_path)
    plan.restrictions = read_restrictions(plan_path)
    env = Environment(plan.gpu, plan.cudnn)
    with open_measurements(store_path, env)[0] as source:
        _echo_warnings(source)
        measured = bool(source.keys(env.gpu, env.cudnn))  # else no speedup columns
        rows = plan_rows(plan, source if measured else None, env)
        click.echo(format_plan_table(plan, rows))
        click.echo(f"baselines from {source.describe()}" if measured
                   else f"no baselines: no {source.describe()}")


@main.command("configs")
def configs_cmd():
    """List the network configs shipped with mucudnn."""
    from .config import find_config, list_configs, load_config
    for name in list_configs():
        path = find_config(name)
        cfg = load_config(path)
        batch = cfg.batch if cfg.batch is not None else "per layer"
        click.echo(f"{name:12s} N={batch!s:<9s} {len(cfg.kernels()):3d} kernels  {path}")


@main.command("env")
def env_cmd():
    """Every MUCUDNN_* setting: its value here, meaning, default and what reads it."""
    from .settings import format_settings
    click.echo(format_settings())


@main.command("build-shim")
@click.option("--force", is_flag=True, help="rebuild even if a build exists")
def build_shim_cmd(force):
    """Compile libmucudnn.so against this environment's cuDNN headers; print its path."""
    from .shimlib import build_shim
    click.echo(str(build_shim(force=force)))


def _shim_env(plan=None, limit=None, record=None, log_level=None, summary=False) -> dict:
    """The command's environment with the shim preloaded; ``plan`` one path or several (the shim
    takes the one for its GPU and cuDNN). A ``MUCUDNN_*`` value its setting does not accept is
    refused (:func:`~mucudnn.settings.check_environment`) before the shim is built."""
    from .settings import check_environment
    from .shimlib import shim_path
    env = dict(os.environ)
    if plan is not None:
        plans = [str(Path(p).resolve()) for p in
                 ([plan] if isinstance(plan, (str, os.PathLike)) else plan)]
        # checked on the paths the shim gets: a directory's files and the working directory count
        for path in plans:
            if ":" in path:
                raise MucudnnError(f"plan {path}: a plan path cannot hold ':' (MUCUDNN_PLAN "
                                   "separates plans with it); rename or move it")
        env["MUCUDNN_PLAN"] = ":".join(plans)
    for name, value in (("MUCUDNN_WORKSPACE_LIMIT", limit), ("MUCUDNN_RECORD", record),
                        ("MUCUDNN_LOG_LEVEL", log_level)):
        if value is not None:
            env[name] = str(Path(value).resolve()) if name == "MUCUDNN_RECORD" else str(value)
    if summary:
        env["MUCUDNN_SUMMARY"] = "1"
    check_environment(env)
    preload = str(shim_path())
    env["LD_PRELOAD"] = preload + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    return env


def _require_command(command: tuple[str, ...]) -> None:
    """Before anything else, so a missing command is not hidden behind building the shim."""
    if not command:
        raise click.UsageError("give the command to run after --")


def _exec(command: tuple[str, ...], env: dict) -> int:
    try:
        return subprocess.call(list(command), env=env)
    except OSError as exc:
        raise MucudnnError(f"cannot run {shlex.join(command)}: {exc}") from None


class BudgetParam(SizeParam):
    """A memory budget: a size over 0, rounded down to whole bytes (5.6GiB)."""

    def convert(self, value, param, ctx):
        from .budget import parse_budget
        try:
            return parse_budget(value)
        except MucudnnError as exc:
            self.fail(str(exc), param, ctx)


memory_budget_option = click.option(
    "--memory-budget", type=BudgetParam(), metavar="SIZE",
    help="limit PyTorch's caching allocator to SIZE on each GPU (through a sitecustomize the "
         "command's Python processes load; not the CUDA context, not other libraries' memory) "
         "and give the shim MUCUDNN_MEMORY_BUDGET")


def _check_offload(offload: bool, budget: int | None) -> None:
    """``--offload`` plans for a budget: without ``--memory-budget`` it is a usage error."""
    if offload and budget is None:
        raise click.UsageError("--offload needs --memory-budget (the budget it plans for)")


def _check_memory_budget(budget: int | None) -> None:
    """Before anything runs: a budget of 0 or over a visible GPU is an error, no GPU a warning."""
    if budget is None:
        return
    from .budget import check_budget
    warning = check_budget(budget)
    if warning:
        click.echo(f"mucudnn: warning: {warning}", err=True)


def _exec_within(budget: int | None, command: tuple[str, ...], env: dict,
                 offload: bool | str = False) -> int:
    """:func:`_exec`, under the memory budget when there is one (and activation offload)."""
    if budget is None:
        return _exec(command, env)
    from .launch import launch_env
    with launch_env(env, budget, command,
                    lambda text: click.echo(f"mucudnn: warning: {text}", err=True),
                    offload=offload) as budgeted:
        return _exec(command, budgeted)


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("-o", "--output", default="mucudnn.record", show_default=True,
              type=click.Path(dir_okay=False), help="record file to append to")
@click.option("--workspace-limit", type=SIZE, help="also keep unplanned kernels within this")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record(output, workspace_limit, command):
    """Run COMMAND (after --) with the shim recording every convolution kernel it runs."""
    from .outputs import RECORDING, refuse_other_kind
    _require_command(command)
    refuse_other_kind(output, RECORDING, appends=True)
    code = _exec(command, _shim_env(limit=workspace_limit, record=output))
    kernels = _recorded_kernels(output)
    if kernels:
        click.echo(f"mucudnn: recording in {output} ({kernels} kernels)", err=True)
    else:
        click.echo(f"mucudnn: warning: {shlex.join(command)} ran no cuDNN convolution the shim saw: "
                   f"nothing was recorded in {output}", err=True)
    sys.exit(code)


def _recorded_kernels(path) -> int:
    """The distinct kernel lines of a record file (0 if there is none)."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    return len({line for line in lines if line.startswith("kernel ")})


def _plan_files(given: tuple[str, ...]) -> list[Path]:
    """The plan files of ``run --plan`` (files, directories standing for their ``*.plan``), each
    read here so that a malformed one is refused with its file and line; a warning where two are
    for the same GPU and cuDNN (the shim takes the first)."""
    from .plan import read_plan
    files: list[Path] = []
    for item in map(Path, given):
        found = sorted(p for p in item.glob("*.plan") if not p.name.startswith(".")) \
            if item.is_dir() else [item]
        if not found:
            raise MucudnnError(f"--plan {item}: no *.plan files in the directory")
        files += found
    for_env: dict[tuple[str, int], Path] = {}
    for path in files:
        plan = read_plan(path)
        first = for_env.setdefault((plan.gpu, plan.cudnn), path)
        if first != path:
            click.echo(f"mucudnn: warning: {first} and {path} are both for {plan.gpu} / cuDNN "
                       f"{plan.cudnn}: the shim takes {first}", err=True)
    return files


#: the largest --workspace-slack: 10x the fastest point's time is no slack a budget wants
MAX_WORKSPACE_SLACK = 1000


def _slack_option(ctx, param, value):
    """``--workspace-slack``: a whole percent (ASCII digits, at most :data:`MAX_WORKSPACE_SLACK`),
    ``off`` (any case) or not given (None)."""
    if value is None:
        return None
    if value.lower() == "off":
        return "off"
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_WORKSPACE_SLACK:
        raise click.BadParameter(f"{value!r}: a whole number of percent from 0 to "
                                 f"{MAX_WORKSPACE_SLACK} (e.g. 5), or off")
    return int(value)


def _set_workspace_choice(env: dict, plan_paths, workspace_slack, offload) -> None:
    """The planned run's slack (``--workspace-slack``, or offload's default) in ``env``, then,
    under offload, the workspace limit its front plans give (one line says it)."""
    from .slack import set_plan_workspace_limit, set_workspace_slack
    set_workspace_slack(env, workspace_slack, offload)
    set_plan_workspace_limit(env, plan_paths, offload, lambda text: click.echo(text, err=True))


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--plan", "plan_paths", multiple=True, type=click.Path(exists=True),
              help="plan file to execute; repeat it, or give a directory of *.plan files, for "
                   "GPUs of several models (each process takes the plan for its GPU and cuDNN)")
@click.option("--no-online", is_flag=True,
              help="without --plan, do not tune online (kernels without a plan pass through)")
@click.option("--online-dir", type=click.Path(file_okay=False),
              help="where online tuning keeps its plan file (default: "
                   "$XDG_CACHE_HOME/mucudnn/online or ~/.cache/mucudnn/online)")
@click.option("--workspace-limit", type=SIZE, help="keep unplanned kernels within this workspace")
@click.option("--log-level", type=click.Choice(["error", "warning", "info", "debug"]))
@click.option("--summary", is_flag=True, help="print what each kernel ran at exit")
@memory_budget_option
@click.option("--offload", is_flag=True,
              help="with --memory-budget: keep, offload to host memory or recompute the tensors "
                   "PyTorch saves for backward, as a plan for the budget says (mucudnn.torch; "
                   "docs/torch.md)")
@click.option("--no-recompute-convolutions", is_flag=True,
              help="with --offload: recompute only cheap modules and adds, never a convolution "
                   "(a rerun convolution whose kernel differs can change the last bits)")
@click.option("--workspace-slack", callback=_slack_option, metavar="PERCENT|off",
              help="each convolution of a --plan front takes its point of least workspace within "
                   "PERCENT of its fastest (default with --offload: 5; off: the fastest)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(plan_paths, no_online, online_dir, workspace_limit, log_level, summary, memory_budget,
        offload, no_recompute_convolutions, workspace_slack, command):
    """Run COMMAND (after --) with the shim executing PLAN's micro-batches.

    With no --plan the shim tunes online (MUCUDNN_ONLINE=1): each convolution is measured on its
    first call, with micro-batches, and runs its fastest plan from then on; what it measured is
    kept in --online-dir, so the next run starts tuned (docs/shim.md, "Online tuning").

    COMMAND may start several processes (`torchrun --nproc-per-node N train.py`): each loads
    the shim, and with several plans takes the one made for its GPU model and cuDNN version;
    online tuning measures each kernel once for all the processes of the node."""
    _require_command(command)
    _check_offload(offload, memory_budget)
    if no_recompute_convolutions and not offload:
        raise click.UsageError("--no-recompute-convolutions needs --offload")
    if offload and no_recompute_convolutions:
        offload = "cheap"
    plans = _plan_files(plan_paths) if plan_paths else None
    _check_memory_budget(memory_budget)
    env = _shim_env(plan=plans, limit=workspace_limit, log_level=log_level, summary=summary)
    if not plans and not no_online:
        env["MUCUDNN_ONLINE"] = "1"
        if online_dir is not None:
            env["MUCUDNN_ONLINE_DIR"] = str(Path(online_dir).resolve())
    else:
        env.pop("MUCUDNN_ONLINE", None)
    _set_workspace_choice(env, plans, workspace_slack, offload)
    from .slack import set_offload_workspace_hold
    set_offload_workspace_hold(env, memory_budget, offload, env.get("MUCUDNN_ONLINE") == "1",
                               lambda text: click.echo(text, err=True))
    sys.exit(_exec_within(memory_budget, command, env, offload=offload))


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--workspace-limit", type=SIZE,
              help="each convolution within this workspace (default: none, a front plan)")
@click.option("--front", is_flag=True, help="a front plan cut at --workspace-limit")
@click.option("--policy", type=POLICIES, default="powerOfTwo", show_default=True)
@click.option("--precise", is_flag=True, help="no FFT/Winograd algorithms")
@click.option("--deterministic", is_flag=True, help="deterministic pieces only (see tune --help)")
@click.option("--borrow-output", is_flag=True, help="as in `tune`")
@click.option("--api", type=APIS, default="both", show_default=True,
              help="benchmark and plan with legacy algorithms, graph-API engine configurations, "
                   "or both")
@click.option("-o", "--plan", "plan_path", default="mucudnn.plan", show_default=True,
              type=click.Path(dir_okay=False), help="plan file to write (and its .record beside)")
@click.option("--record-command", metavar="'CMD ...'",
              help="a shorter command that runs the same convolutions (e.g. 2 steps); default: "
                   "COMMAND itself")
@memory_budget_option
@click.option("--offload", is_flag=True,
              help="with --memory-budget: both runs of COMMAND as `run --offload` (saved tensors "
                   "kept, offloaded or recomputed within the budget)")
@click.option("--workspace-slack", callback=_slack_option, metavar="PERCENT|off",
              help="as `run --workspace-slack` (default with --offload: 5)")
@store_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def autotune(workspace_limit, front, policy, precise, deterministic, borrow_output, api, plan_path,
             record_command, memory_budget, offload, workspace_slack, store_path, command):
    """Record what COMMAND (after --) runs, benchmark and tune it on this GPU, then run COMMAND
    with the plan: `record`, `bench --recording`, `tune --recording` and `run` in one go.
    With no --workspace-limit the plan is a front plan (see tune --help). --memory-budget (and
    --offload) applies to both runs of COMMAND, not to benchmarking.

    COMMAND may start several processes (`torchrun --nproc-per-node N train.py`): every rank
    appends to the one recording (whole lines; each kernel is tuned once), benchmarking is
    spread over the visible GPUs (see bench --help), and on GPUs of several models one plan per
    model is written beside -o (NAME.<model>.plan), each rank running the one for its GPU."""
    from .outputs import PLAN, RECORDING, refuse_inputs_as_output, refuse_other_kind
    from .plan import read_recording_weights
    from .tuner import benchmark
    _require_command(command)
    _check_front_options(workspace_limit, None, front, borrow_output)
    if policy == "fit" and workspace_limit is None:
        raise click.UsageError("--policy fit needs --workspace-limit (the sizes that fit it)")
    _check_output(plan_path)
    _check_offload(offload, memory_budget)
    _check_memory_budget(memory_budget)
    recording = Path(plan_path).with_suffix(".record")
    refuse_inputs_as_output(plan_path, [("recording", recording)] + _inputs(None, (), store_path))
    refuse_other_kind(plan_path, PLAN)
    refuse_other_kind(recording, RECORDING, option="its recording")
    # The run records into a fresh file beside the target; plan and recording replace the old ones
    # only once tuning succeeded, so a failing command leaves both as they were.
    fresh = recording.with_name(f".{recording.name}.{os.getpid()}.tmp")
    fresh.unlink(missing_ok=True)
    try:
        recorder = tuple(shlex.split(record_command)) if record_command else command
        click.echo(f"mucudnn: 1/4 recording: {shlex.join(recorder)}", err=True)
        code = _exec_within(memory_budget, recorder, _shim_env(limit=workspace_limit, record=fresh),
                            offload=offload)
        kernels = read_recording_weights([fresh]) if fresh.exists() else []
        if code != 0 or not kernels:
            raise MucudnnError(f"the recording run exited with {code} and recorded "
                               f"{len(kernels) or 'no'} kernels; {recording} and {plan_path} "
                               "are left as they were")
        click.echo(f"mucudnn: 2/4 benchmarking {len(kernels)} kernels", err=True)
        benchmark(kernels, policy, store=store_path, api=api, workspace_limit=workspace_limit,
                  borrow_output=borrow_output)
        click.echo("mucudnn: 3/4 tuning", err=True)
        plans = []
        for env, path in _plans_per_gpu_model(plan_path):
            plan = _optimize(kernels, workspace_limit=workspace_limit, policy=policy,
                             store=store_path, env=env, precise=precise, api=api,
                             borrow_output=borrow_output, deterministic=deterministic,
                             front=front)
            plans.append((path, plan))
        for path, plan in plans:
            _write_plan_file(plan, path)
        os.replace(fresh, recording)
    finally:
        fresh.unlink(missing_ok=True)
    for path, plan in plans:
        click.echo(f"mucudnn: wrote {path}: {_plan_summary(plan)}"
                   + (f" (for {plan.gpu})" if len(plans) > 1 else ""), err=True)
    click.echo(f"mucudnn: 4/4 running: {shlex.join(command)}", err=True)
    plan_paths = [path for path, _ in plans]
    env = _shim_env(plan=plan_paths, limit=workspace_limit)
    _set_workspace_choice(env, plan_paths, workspace_slack, offload)
    sys.exit(_exec_within(memory_budget, command, env, offload=offload))


def _plans_per_gpu_model(plan_path) -> list[tuple[object, Path]]:
    """(environment, plan file) of each plan autotune writes: ``plan_path`` for this GPU (or,
    with no GPU, the measurements' own); on a node with GPUs of several models, one per model,
    ``NAME.<model>.plan`` beside it (every model was benchmarked, see ``bench --gpus``)."""
    import re

    from .tuner import gpu_models_here
    models = gpu_models_here()
    if len(models) <= 1:
        return [(models[0] if models else None, Path(plan_path))]
    path = Path(plan_path)
    return [(env, path.with_name(f"{path.stem}.{re.sub(r'[^A-Za-z0-9]+', '_', env.gpu).strip('_')}"
                                 f"{path.suffix or '.plan'}")) for env in models]


@main.command("batch-size", context_settings={"ignore_unknown_options": True})
@click.option("--memory-budget", type=BudgetParam(), metavar="SIZE", required=True,
              help="the budget every run is held to (as in `run`)")
@click.option("--offload", is_flag=True, help="run each candidate with `run --offload`")
@click.option("--start", type=int, default=8, show_default=True, help="first batch size")
@click.option("--largest", type=int, default=4096, show_default=True, help="largest to try")
@click.option("--multiple", type=int, help="bisect to a multiple of this (default: --start)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def batch_size(memory_budget, offload, start, largest, multiple, command):
    """Find the batch size with the most images/s that holds under --memory-budget: runs COMMAND
    (after --, with {} for the batch size) for candidates (doubling, then bisection); the script
    prints `mucudnn-throughput: <images/s>`. Prints the pick on stdout, why on stderr."""
    from .batchsize import check_command, explain, tune

    check_command(command)
    _check_memory_budget(memory_budget)

    def say(text):
        click.echo(f"mucudnn: {text}", err=True)

    best, trials, margin = tune(lambda batch: _batch_trial(command, batch, memory_budget, offload),
                                memory_budget, start=start, largest=largest, multiple=multiple,
                                say=say)
    for line in explain(best, trials, memory_budget, margin):
        say(line)
    click.echo(best.batch)


def _batch_trial(command, batch, budget, offload):
    """One run of the training command at ``batch``: its exit status, throughput and peak."""
    from .batchsize import Trial, command_for, parse_throughput
    from ._torch_site.mucudnn_torch_env import ENV_REPORT
    from .launch import launch_env

    argv = command_for(command, batch)
    with launch_env(_shim_env(), budget, tuple(argv), lambda text: None,
                    offload=offload) as env:
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace")
        except OSError as exc:
            raise MucudnnError(f"cannot run {shlex.join(argv)}: {exc}") from None
        events = Path(env[ENV_REPORT]).read_text().splitlines()
    peaks = [int(line.split()[3]) for line in events
             if line.startswith("peak ") and len(line.split()) == 4]
    output = done.stdout + done.stderr
    note = ""
    if done.returncode != 0:
        note = ("out of memory" if "out of memory" in output.lower()
                else f"exit {done.returncode}: " + (output.strip().splitlines() or [""])[-1][:120])
    return Trial(batch, done.returncode, parse_throughput(done.stdout),
                 max(peaks) if peaks else None, note)


main.add_command(store_group)
main.add_command(offload_plan)

if __name__ == "__main__":  # pragma: no cover
    main()
