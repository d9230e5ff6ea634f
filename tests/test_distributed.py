"""Data-parallel runs under torchrun (gloo, 2 ranks) against one process; the rank context with one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nip_like.checkpoint import load_checked
from nip_like.distributed import Distributed, current
from nip_like.errors import CheckpointError, ConfigError
from nip_like.experiment import run_experiment
from nip_like.logging import read_csv_metric
from nip_like.trainers.rl import TensorDictRlTrainer
from tests.conftest import REPO_ROOT, built_once, run_cli, smoke_config
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_checkpoint import lm_overrides

PROBE = REPO_ROOT / "tests" / "distributed_probe.py"

#: Tiny graph agents on graph isomorphism, PPO; grad_accumulation_steps at its default (null: one minibatch per rank).
GRAPH_AGENTS = ("scenario=graph_isomorphism", "protocol=nip", "scenario.num_pairs=200")
#: The same; two minibatches of each optimiser step per rank pair.
GRAPH = (*GRAPH_AGENTS, "trainer.optimizer.grad_accumulation_steps=2")


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "NIP_LIKE_DISTRIBUTED_TIMEOUT": "120"}


def torchrun(args: list[str], script: list[str] | None = None, module: str = "nip_like", **kwargs):
    """The command of a 2-rank torchrun (gloo) of ``python -m <module> args`` (or of ``script``)."""
    target = script if script is not None else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", *target, *args]


def run(command: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, env=_environment(), capture_output=True, text=True, timeout=timeout)


def cli_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["preset=smoke", "run.progress_bar=false", "run.num_threads=1", f"scenario.cache_dir={tmp_path / 'data'}", *overrides]


def parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checked(run_dir / "checkpoints" / "last.pt")["trainer"]["loss_module"]


def _replaying(monkeypatch, record_dir: Path) -> None:
    """Make a one-process run optimise on what rank 0 of a torchrun run recorded (data and generator state)."""
    fill = TensorDictRlTrainer.fill_buffer

    def replay(self, data):
        record = torch.load(record_dir / f"{self.state.iteration + 1}.pt", weights_only=False)
        torch.set_rng_state(record["rng"])
        return fill(self, record["data"])

    monkeypatch.setattr(TensorDictRlTrainer, "fill_buffer", replay)


def _probe_run(folder: Path, overrides: tuple[str, ...], settings: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """A 3-iteration torchrun run of ``overrides`` and ``settings`` under the probe, in ``folder``.

    Its data cache goes to ``folder/data``, rank 0's records to ``folder/record``
    and the run to ``folder/two``.
    """
    args = cli_args(folder, *overrides, *settings, "trainer.num_iterations=3")
    return run(torchrun([*args, f"hydra.run.dir={folder / 'two'}"], script=[str(PROBE), str(folder / "record"), "--"]))


#: Torchrun runs that two tests share (made once per session by ``shared_probe_run``): name -> (the overrides, given
#: the run's folder, and the run settings). Each is a test's two-rank run against one process and another test's
#: uninterrupted reference for a killed and resumed run of the same config.
SHARED_RUNS = {
    "graph": (lambda folder: GRAPH_AGENTS, ()),
    "lora-fsdp": (lambda folder: (*lm_overrides(folder), "trainer.eval.metric=eval/accuracy", "scenario.default_agent.lora.r=4",
                                  "trainer.optimizer.grad_accumulation_steps=2"), ("run.fsdp=true",)),
}


@pytest.fixture(scope="session")
def shared_probe_run(tmp_path_factory):
    """A function of a name of :data:`SHARED_RUNS`: that finished run's folder (see :func:`_probe_run`), its overrides
    and torchrun's standard output, made once for the whole session, pytest-xdist workers included."""

    def made(name: str) -> tuple[Path, tuple[str, ...], str]:
        overrides_of, settings = SHARED_RUNS[name]

        def build(folder: Path) -> None:
            result = _probe_run(folder, overrides_of(folder), settings)
            assert result.returncode == 0, result.stderr[-3000:]
            (folder / "stdout.txt").write_text(result.stdout)  # written last: the run finished

        folder = built_once(tmp_path_factory, f"distributed_{name}", "stdout.txt", build)
        return folder, overrides_of(folder), (folder / "stdout.txt").read_text()

    return made


def _two_ranks_against_one(
    tmp_path, monkeypatch, overrides: tuple[str, ...], settings: tuple[str, ...] = (), one: tuple[str, ...] | None = None,
    shared: tuple[Path, str] | None = None,
) -> str:
    """``settings``: run settings of the torchrun run only (``run.fsdp=true``); ``one``: the one-process run's overrides, if others;
    ``shared``: the folder and standard output of a finished :func:`_probe_run` of ``overrides`` and ``settings``, if any.

    Returns the torchrun run's standard output.
    """
    if shared is None:
        folder = tmp_path
        distributed = _probe_run(folder, overrides, settings)
        assert distributed.returncode == 0, distributed.stderr[-3000:]
        stdout = distributed.stdout
    else:
        folder, stdout = shared

    # One process, optimising on the same global batches (and the same generator state at each update).
    _replaying(monkeypatch, folder / "record")
    one = overrides if one is None else one
    run_experiment(smoke_config(*one, "trainer.num_iterations=3", f"scenario.cache_dir={folder / 'data'}"), tmp_path / "one")

    two, one = parameters(folder / "two"), parameters(tmp_path / "one")
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=key)
    # The runs trained: the parameters moved from their initial values.
    initial = load_initial(tmp_path, overrides, folder / "data")
    assert any(not torch.equal(one[key], value) for key, value in initial.items() if key in one)

    # The model folders beside the checkpoint (LM agents) hold the same weights: a sharded run writes them whole.
    for model in sorted((tmp_path / "one" / "checkpoints" / "last").glob("*/*.safetensors")):
        written = load_file(folder / "two" / model.relative_to(tmp_path / "one"))
        for key, value in load_file(model).items():
            torch.testing.assert_close(written[key], value, rtol=1e-5, atol=1e-6, msg=f"{model.name}: {key}")

    # Only rank 0 wrote the folder: one metrics file per metric, one row per step, one summary.
    summary = json.loads((folder / "two" / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["iterations"] == 3
    assert summary["frames"] == 3 * 96  # the global batch (smoke: 96 frames), half from each rank
    assert [step for step, _ in read_csv_metric(folder / "two", "train/iteration")] == [1, 2, 3]
    assert not (folder / "two" / "run.lock").exists()
    assert "Final test metrics" in stdout and stdout.count("Final test metrics") == 1
    return stdout


def load_initial(tmp_path, overrides, cache: Path) -> dict[str, torch.Tensor]:
    """The loss module's state of a freshly built trainer of the same config (its data cache in ``cache``)."""
    from nip_like.experiment import build_trainer

    config = smoke_config(*overrides, f"scenario.cache_dir={cache}")
    return build_trainer(config, tmp_path / "initial").loss_module.state_dict()


@pytest.mark.slow
def test_two_ranks_train_graph_agents_like_one_process_on_the_same_global_batch(tmp_path, monkeypatch, shared_probe_run):
    # grad_accumulation_steps left at its default (null; torchrun's ranks were refused there): each optimiser step
    # takes one whole minibatch per rank, exactly as one process with grad_accumulation_steps=2.
    # The torchrun run is also the reference of test_killed_two_rank_run_resumes_to_the_same_final_metrics[graph].
    folder, overrides, stdout = shared_probe_run("graph")
    one = (*overrides, "trainer.optimizer.grad_accumulation_steps=2")
    assert (*GRAPH_AGENTS, "trainer.optimizer.grad_accumulation_steps=2") == GRAPH
    stdout = _two_ranks_against_one(tmp_path, monkeypatch, overrides, one=one, shared=(folder, stdout))
    assert stdout.count("trainer.optimizer.grad_accumulation_steps is null: each optimiser step takes 2 "
                           "minibatches, one per rank") == 1  # logged once, by rank 0


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["lola", "dpo"])
def test_two_ranks_train_on_episodes_of_every_length_like_one_process(tmp_path, monkeypatch, trainer):
    # Graph isomorphism's episodes end when the verifier decides: each rank pads its episodes (lola) or its
    # preference pairs' episodes (dpo) to its own longest; the joined layout pads them to the longest of all.
    # lola's loss also differentiates through the other agents' updates (second derivatives) inside DDP's forward.
    _two_ranks_against_one(tmp_path, monkeypatch, (*GRAPH, f"trainer={trainer}"))


@pytest.mark.slow
@pytest.mark.parametrize("objective", [(), ("trainer=dpo", "trainer.minibatch_size=4")], ids=["ppo", "dpo"])
def test_two_ranks_train_language_model_agents_like_one_process_on_the_same_global_batch(tmp_path, monkeypatch, objective):
    overrides = (*lm_overrides(tmp_path), "trainer.eval.metric=eval/accuracy", *objective, "trainer.optimizer.grad_accumulation_steps=2")
    _two_ranks_against_one(tmp_path, monkeypatch, overrides)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        # Micro-batches of at most 64 tokens (two sequences): the ranks score different numbers of them (stand-in passes).
        # One epoch, not the smoke preset's two: every minibatch is split in micro-batches and scored with stand-in
        # passes alike, and with two epochs this variant's updates took 7-12 s per iteration at load (an all-gather
        # of the sharded weights per micro-batch), against about 1 s for the other variants.
        ("scenario.default_agent.max_tokens_per_micro_batch=64", "trainer.num_epochs=1"),
        ("trainer=dpo", "trainer.minibatch_size=4"),
        ("scenario.default_agent.lora.r=4",),
    ],
    ids=["ppo-micro-batches", "dpo", "ppo-lora"],
)
def test_two_sharded_ranks_train_language_model_agents_like_one_process(tmp_path, monkeypatch, shared_probe_run, variant):
    # FSDP2 (run.fsdp): each rank holds half of every agent; the result is the replicated one-process run's.
    overrides = (*lm_overrides(tmp_path), "trainer.eval.metric=eval/accuracy", *variant, "trainer.optimizer.grad_accumulation_steps=2")
    folder, shared = tmp_path, None
    if variant == ("scenario.default_agent.lora.r=4",):
        # The same torchrun run is the reference of test_killed_two_rank_run_resumes_to_the_same_final_metrics[lm-fsdp].
        folder, overrides, stdout = shared_probe_run("lora-fsdp")
        assert SHARED_RUNS["lora-fsdp"][1] == ("run.fsdp=true",)
        shared = folder, stdout
    _two_ranks_against_one(tmp_path, monkeypatch, overrides, settings=("run.fsdp=true",), shared=shared)
    if not any("max_tokens_per_micro_batch" in setting for setting in variant):
        # The automatic token budget holds for sharded agents too: probed before sharding, logged with the first iteration.
        for agent in ("prover", "verifier"):
            [(step, budget)] = read_csv_metric(folder / "two", f"lm/memory/{agent}/budget_tokens")
            assert step == 1 and budget >= 1


@pytest.mark.slow
@pytest.mark.parametrize("settings", [(), ("run.fsdp=true",)], ids=["replicated", "fsdp"])
def test_two_ranks_of_agents_on_one_base_train_like_one_process_of_two_copies(tmp_path, monkeypatch, chat_model, settings):
    # share_base_with: the verifier's model is a module tree over the prover's frozen base tensors, each with its own
    # adapters; under torchrun (replicated, or each tree sharded by FSDP2) it trains as separate copies do in one process.
    folder = chat_model("qwen2")
    agents = (
        "scenario=duplicates", "protocol=nip", "protocol.first_speaker=prover", "protocol.max_rounds=2", "scenario.view=chat",
        "scenario.num_lists=60", "scenario.length=6", "scenario.num_values=12", "trainer.eval.metric=eval/accuracy",
        f"scenario.default_agent.pretrained_path={folder}", "scenario.default_agent.max_new_tokens=12", "scenario.default_agent.lora.r=4",
        "trainer.optimizer.grad_accumulation_steps=2",
        # Smaller than the smoke preset where the claim does not look (the weights after each update are compared):
        # one epoch, not two, and 16 evaluation and test episodes, not 32 and 64. Each iteration took 4-6 s at load,
        # most of it the update, and the chat models' test and evaluation episodes are generated token by token.
        "trainer.num_epochs=1", "trainer.eval.num_episodes=16", "trainer.num_test_episodes=16", "trainer.test_batch_episodes=16",
    )
    verifier = f"+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: 12, lora: {{r: 4}}"
    shared, copies = (*agents, verifier + ", share_base_with: prover}"), (*agents, verifier + "}")
    _two_ranks_against_one(tmp_path, monkeypatch, shared, settings=settings, one=copies)


@pytest.mark.slow
@pytest.mark.parametrize("agents", ["graph", "lm-fsdp"])
def test_a_failing_rank_stops_the_others_with_its_one_line_error(tmp_path, agents):
    # lm-fsdp: rank 0 waits in FSDP2's all-gather of the sharded agents' weights, not in one of nip_like's collectives.
    chosen = GRAPH if agents == "graph" else (*lm_overrides(tmp_path), "trainer.eval.metric=eval/accuracy",
                                               "trainer.optimizer.grad_accumulation_steps=2", "run.fsdp=true")
    args = cli_args(tmp_path, *chosen, "trainer.num_iterations=5", f"hydra.run.dir={tmp_path / 'run'}")
    started = time.time()
    # Rank 1 fails as its iteration 2 starts, while rank 0 waits for it in a collective.
    result = run(torchrun(args, script=[str(PROBE), str(tmp_path / "record"), "1", "2", "--"]), timeout=200)
    assert result.returncode != 0
    assert time.time() - started < 150, "the other rank must stop, not wait for the timeout"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1: probe failure on rank 1 at iteration 2"]
    # The ranks themselves print no traceback (torchrun's own report of the failed rank follows theirs).
    assert result.stderr.index("Traceback") > result.stderr.index(errors[0]) if "Traceback" in result.stderr else True
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fails", [False, True], ids=["slow-build", "slow-build-fails"])
def test_the_ranks_wait_for_a_build_of_rank_zero_longer_than_the_collective_timeout(tmp_path, fails):
    # Rank 0 builds first (a warm start may take hours) while the others wait beyond NIP_LIKE_DISTRIBUTED_TIMEOUT;
    # a build that fails still stops them at once.
    args = cli_args(tmp_path, *GRAPH, "trainer.num_iterations=1", f"hydra.run.dir={tmp_path / 'run'}")
    # A collective timeout of 8 s, above the ranks' start-up skew (they join the group within a few seconds of
    # each other even on a loaded machine), and a build 6 s longer than it: the other rank waits past the timeout.
    # Both were 10 s and 25 s: the sleep is wall time, 11 s of it cut per test.
    build_seconds = 14
    environment = {**_environment(), "NIP_LIKE_DISTRIBUTED_TIMEOUT": "8", "NIP_LIKE_PROBE_SLOW_BUILD": str(build_seconds)}
    if fails:
        environment["NIP_LIKE_PROBE_FAIL_BUILD"] = "1"
    command = torchrun(args, script=[str(PROBE), str(tmp_path / "record"), "--"])
    started = time.time()
    result = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=200)
    if not fails:
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 1
    else:
        assert result.returncode != 0  # torchrun's own status for a failed rank
        assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
            "error: probe failure while rank 0 builds"
        ]
        assert time.time() - started < build_seconds + 60, "the other rank must stop at once, not wait for a timeout"


def _iteration_of(path: Path) -> int:
    try:
        return load_checked(path)["trainer"]["train_state"]["iteration"]
    except CheckpointError:
        return -1


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process below it, and wait until all have ended."""
    victims = [*_descendants(process.pid), process.pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_running(pid) for pid in victims):
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("agents", ["graph", "lm-fsdp"])
def test_killed_two_rank_run_resumes_to_the_same_final_metrics(tmp_path, agents, shared_probe_run):
    # lm-fsdp: LoRA language-model agents sharded with FSDP2 (a checkpoint holds whole tensors, each rank its shards).
    # The reference, an uninterrupted run of the same config, is the torchrun run of
    # test_two_ranks_train_graph_agents_like_one_process_on_the_same_global_batch (graph) or of
    # test_two_sharded_ranks_train_language_model_agents_like_one_process[ppo-lora] (lm-fsdp), made once for both
    # (the probe only records what the run collects). It was a run of its own, of 8 iterations, killed after 3.
    # 3 iterations (smoke: a checkpoint after each, an evaluation at 2), killed once iteration 1 is saved: the
    # resumed run evaluates and tests. An iteration takes over a second, the kill lands within a poll of 0.05 s.
    name = "graph" if agents == "graph" else "lora-fsdp"
    folder, chosen, _ = shared_probe_run(name)
    args = cli_args(folder, *chosen, *SHARED_RUNS[name][1], "trainer.num_iterations=3")
    reference = folder / "two"

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        torchrun([*args, f"hydra.run.dir={killed}"]), cwd=REPO_ROOT, env=_environment(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    checkpoint = killed / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and _iteration_of(checkpoint) < 1:
        time.sleep(0.05)
    _kill_tree(process)  # torchrun and both ranks (its workers may be in sessions of their own)
    assert 0 < _iteration_of(checkpoint) < 3, "the run must be killed part-way"
    assert not (killed / "summary.json").exists()

    resumed = run(torchrun([str(killed), "run.progress_bar=false"], module="nip_like.resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = json.loads((killed / "summary.json").read_text())
    expected = json.loads((reference / "summary.json").read_text())
    assert final["test_metrics"] == expected["test_metrics"]
    assert final["frames"] == expected["frames"] and final["resumed"]
    for key, value in parameters(reference).items():
        assert torch.equal(parameters(killed)[key], value), key
    for metric in ("loss/policy", "train/reward", "eval/accuracy"):
        assert read_csv_metric(killed, metric) == read_csv_metric(reference, metric)

    # A checkpoint of two ranks is refused by one process, in one line.
    alone = run([sys.executable, "-m", "nip_like.resume", str(killed)])
    refusal = "written by a run of 2 rank(s)" if agents == "graph" else "run.fsdp=true shards the agents over torchrun's ranks"
    assert alone.returncode == 2 and refusal in alone.stderr and len(alone.stderr.strip().splitlines()) == 1


def test_one_rank_context_does_nothing():
    context = current()
    assert not context.enabled and context.is_writer and context.world_size == 1
    assert context.share(96, "trainer.frames_per_batch") == 96
    assert context.gather({"a": 1}) == [{"a": 1}] and context.mean({"x": 2.0}) == {"x": 2.0}
    assert context.owns(0) and context.owns(3) and context.any(True) and not context.any(False)
    state = torch.get_rng_state()
    with context.rank_rng(0):
        assert torch.equal(torch.get_rng_state(), state)


def test_only_errors_of_the_process_group_are_taken_for_a_peer_failure():
    from nip_like.distributed import PeerFailure

    dist = Distributed(rank=1, world_size=2)
    # This rank's own error inside a collective (DDP reduces in the backward pass): reported as it is.
    with pytest.raises(torch.OutOfMemoryError), dist.collective():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(PeerFailure) as gone, dist.collective():
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert gone.value.quiet and str(gone.value).startswith("rank 1: another rank stopped")
    with pytest.raises(PeerFailure) as silent, dist.collective():
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    assert not silent.value.quiet and "no answer from the other ranks in time" in str(silent.value)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_accumulation_left_null_is_one_minibatch_per_rank_and_an_explicit_one_must_divide():
    from nip_like.config import run_id
    from nip_like.trainers.update import accumulation_steps

    assert [accumulation_steps(None, ranks) for ranks in (1, 2, 4)] == [1, 2, 4]
    assert accumulation_steps(4, 2) == 4 and accumulation_steps(3, 1) == 3
    with pytest.raises(ConfigError, match=(
        r"^trainer.optimizer.grad_accumulation_steps \(1\) must be a multiple of the number of ranks \(2\): the ranks "
        r"share each optimiser step's minibatches; or leave it unset \(null\) for one minibatch per rank$"
    )):
        accumulation_steps(1, 2)
    # The default was 1 before it was null: runs keep their ids (null keys as 1, which it is in one process).
    assert smoke_config().trainer.optimizer.grad_accumulation_steps is None
    assert run_id(smoke_config()) == run_id(smoke_config("trainer.optimizer.grad_accumulation_steps=1"))
    assert run_id(smoke_config()) != run_id(smoke_config("trainer.optimizer.grad_accumulation_steps=2"))


@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf", "nan", "1e300"])
def test_a_timeout_variable_that_is_no_positive_number_of_seconds_is_refused_in_one_line(monkeypatch, value):
    from nip_like.distributed import timeout_from_environment

    monkeypatch.setenv("NIP_LIKE_BUILD_TIMEOUT", value)
    with pytest.raises(ConfigError, match=rf"^NIP_LIKE_BUILD_TIMEOUT='{value}' must be a positive number of seconds \(default 60\)$"):
        timeout_from_environment("NIP_LIKE_BUILD_TIMEOUT", 60)
    monkeypatch.setenv("NIP_LIKE_BUILD_TIMEOUT", " 2.5 ")
    assert timeout_from_environment("NIP_LIKE_BUILD_TIMEOUT", 60).total_seconds() == 2.5
    monkeypatch.delenv("NIP_LIKE_BUILD_TIMEOUT")
    assert timeout_from_environment("NIP_LIKE_BUILD_TIMEOUT", 60).total_seconds() == 60


@pytest.mark.parametrize("rank", [0, 1])
def test_an_error_under_torchrun_goes_to_the_error_file_torchrun_reports(tmp_path, monkeypatch, capsys, rank):
    # torchrun's report of a failed rank shows the file's message (else a link to how to record a traceback).
    from nip_like.cli import report_errors

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", str(rank))
    with pytest.raises(SystemExit) as exit_info, report_errors():
        raise ConfigError("trainer.num_envs (15) must be a multiple of the number of ranks (2)")
    assert exit_info.value.code == 2
    line = "error: trainer.num_envs (15) must be a multiple of the number of ranks (2)"
    assert capsys.readouterr().err == (f"{line}\n" if rank == 0 else "")  # a config error: rank 0 alone prints it
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == recorded["extraInfo"]["py_callstack"] == line
    assert int(recorded["extraInfo"]["timestamp"]) > 0  # torchrun reads it as an int


def test_a_rank_share_that_does_not_divide_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^trainer.num_envs \(15\) must be a multiple of the number of ranks \(2\)$"):
        Distributed(rank=1, world_size=2).share(15, "trainer.num_envs")
    assert Distributed(rank=1, world_size=2).owns(1) and not Distributed(rank=1, world_size=2).owns(2)


def test_a_rank_that_left_the_group_keeps_its_rank_and_does_not_join_again(monkeypatch):
    # nip_like.resume asked current() after shutdown(): the rank joined the group again and waited
    # for ranks that had ended (gloo's "connectFullMesh failed", or a hang).
    import nip_like.distributed as module

    monkeypatch.setattr(module, "_current", Distributed(rank=1, world_size=2))
    module.shutdown()
    context = current()
    assert context.rank == 1 and not context.enabled and not context.is_writer
    monkeypatch.setattr(module, "_current", None)


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    timeout = "error: NIP_LIKE_DISTRIBUTED_TIMEOUT='abc' must be a positive number of seconds (default 1800)"
    cases = [  # a relation between fields; an unknown key; a variable of ours, read as the ranks join (before Hydra)
        ("trainer.num_envs=15", {}, "error: trainer.frames_per_batch (96) must be a multiple of trainer.num_envs (15)"),
        ("trainer.bogus=1", {}, "error: unknown config key trainer.bogus"),
        ("seed=0", {"NIP_LIKE_DISTRIBUTED_TIMEOUT": "abc"}, timeout),
    ]
    for override, variables, expected in cases:
        command = torchrun(["preset=smoke", "run.progress_bar=false", override, f"hydra.run.dir={tmp_path / 'run'}"])
        result = subprocess.run(command, cwd=REPO_ROOT, env={**_environment(), **variables}, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode != 0 and not (tmp_path / "run" / "checkpoints").exists()
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and errors[0].startswith(expected), result.stderr[-2000:]
        # torchrun's report of the failed ranks follows (its log lines, its own traceback, a table of the ranks:
        # 42-44 lines in all, where a bad variable gave 72, with a Python traceback per rank), and its root cause
        # is our line, from the error file torchrun reads, not a link to how to record a traceback.
        lines = (result.stdout + result.stderr).splitlines()
        assert len(lines) <= 50 and result.stderr.count("Traceback") == 1, result.stderr
        root_cause = result.stderr[result.stderr.index("Root Cause"):]
        assert f"traceback : {errors[0]}" in root_cause, root_cause


@pytest.mark.slow
def test_fsdp_in_one_process_is_refused_in_one_line_before_the_run_folder(tmp_path):
    result = run_cli(["preset=smoke", "run.fsdp=true", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip() == (
        "error: run.fsdp=true shards the agents over torchrun's ranks: start with torchrun --nproc_per_node=N (N >= 2), "
        "or set run.fsdp=false"
    )


def test_fsdp_where_it_cannot_apply_is_refused_in_one_line(tmp_path, monkeypatch):
    from nip_like.validation import build_scenario
    from nip_like.validation import check_fsdp
    from nip_like.registry import TRAINERS

    with pytest.raises(ConfigError, match=r"^run.fsdp=true shards the agents over torchrun's ranks"):
        check_fsdp(smoke_config("run.fsdp=true"), TRAINERS.entry("ppo").cls, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    graph = smoke_config(*GRAPH, "run.fsdp=true", f"scenario.cache_dir={tmp_path}")
    scenario = build_scenario(graph)
    with pytest.raises(ConfigError, match=r"^run.fsdp=true shards language-model agents; scenario graph_isomorphism has none"):
        check_fsdp(graph, TRAINERS.entry("ppo").cls, scenario)
    lm = smoke_config("run.fsdp=true", *lm_overrides(tmp_path))
    scenario = build_scenario(lm)
    with pytest.raises(ConfigError, match=r"^run.fsdp=true: trainer ppo does not shard .*; allowed: .*\bdpo\b.*\bppo\b"):
        check_fsdp(lm, TRAINERS.entry("pola").cls, scenario)
    check_fsdp(lm, TRAINERS.entry("grpo").cls, scenario)  # an LM scenario, a standard update: allowed
    chunked = smoke_config("run.fsdp=true", *lm_overrides(tmp_path), "scenario.default_agent.score_chunk_tokens=2")
    with pytest.raises(ConfigError, match=r"^scenario.default_agent.score_chunk_tokens=2 and run.fsdp=true do not go together"):
        check_fsdp(chunked, TRAINERS.entry("ppo").cls, build_scenario(chunked))
    for setting in ("null", "0"):  # automatic (off for a sharded agent) and off: allowed
        allowed = smoke_config("run.fsdp=true", *lm_overrides(tmp_path), f"scenario.default_agent.score_chunk_tokens={setting}")
        check_fsdp(allowed, TRAINERS.entry("ppo").cls, build_scenario(allowed))


def test_the_ranks_of_one_machine_are_torchruns_local_world_size(monkeypatch):
    # The automatic token budget splits a CPU machine's memory among them (a GPU is each rank's own).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Distributed(0, 4).local_world_size == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Distributed(0, 4).local_world_size == 4 and Distributed().local_world_size == 1
