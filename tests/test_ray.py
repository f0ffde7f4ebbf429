"""Members as Ray actors (ensemble_core.remote), on a real two-node Ray cluster: no mocks.

The cluster is ``ray.cluster_utils.Cluster`` with two nodes of one CPU each, each with a
custom resource (``node_a`` / ``node_b``) that pins one bundled member to it. Greedy
outputs must equal the local members' exactly (the recorded ones of ``tests/golden``); a member killed mid-generation must raise
the typed error (never hang) and the next request must work after Ray restarts it; a member
whose actor is dead for good (or of an earlier Ray session) must say so, and a new Ensemble of
it must get a fresh actor; and 100 requests must leave no decoding state behind in the actors.

Ray is a dev dependency: a missing Ray fails this module, it is never skipped.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from ensemble_core import Ensemble, Member
from ensemble_core.errors import ConfigurationError, MemberUnavailableError
from ensemble_core.remote import RayMemberSpec, RayOptions, RemoteMember
from ensemble_core.remote import cluster as remote_cluster

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import record  # noqa: E402

pytestmark = pytest.mark.real
RECORDED = json.loads(record.OUT.read_text())

STORE = 80 * 2**20
MEMBERS = ("smollm2-135m-instruct", "gemma3-270m")
NODES = ("node_a", "node_b")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Translate 'good morning' into German.",
    "def fibonacci(n):\n    # complete this Python function",
    "Explain in one sentence why the sky is blue.",
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "How many legs has a spider?"}],
    "Quel est le plus long fleuve de France ?",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci and say where it hangs.",
]
SHORT = ["Hi!", "2+2?", "Say yes.", "Red or blue?", "Name a fruit.", "Hello there.", "Pick a number."]
TOKENS = 24
#: Generous: a bound, not a speed requirement (2 shared cores, an actor reloading its model).
OPTIONS = RayOptions(call_timeout_s=120.0, start_timeout_s=300.0, max_restarts=2)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    # Ray's memory monitor kills a worker once the whole node is at 95 % (default), counting this test
    # process and its neighbours (23.5 GB box: killed at 22.4 GB in full runs while the actors held ~1 GB):
    # 98 % here, the kernel's OOM killer stays the last guard
    os.environ.setdefault("RAY_memory_usage_threshold", "0.98")
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {NODES[0]: 1}, "object_store_memory": STORE, "include_dashboard": False},
    )
    c.add_node(num_cpus=1, resources={NODES[1]: 1}, object_store_memory=STORE)
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def remote_pair(cluster: Cluster) -> list[RemoteMember]:
    ensemble = Ensemble([RayMemberSpec(m, resources={n: 1}) for m, n in zip(MEMBERS, NODES)], ray_options=OPTIONS)
    yield ensemble.members
    ensemble.close()


def held(members: list[RemoteMember], tries: int = 10) -> list[int]:
    """States the actors hold once every state dropped here has been freed: ``tries`` looks at most.

    A finished request's states are freed by finalizers when its last local reference goes;
    in 2 of 3 full-suite runs on the loaded 2-core machine (2026-12-03) one request's pair of
    states was still alive at the first look right after ``generate`` returned (never when
    this file runs alone; not root-caused). A leak still fails: it never reaches 0.
    """
    for _ in range(tries):
        counts = [m.held_states() for m in members]
        if not any(counts):
            break
        gc.collect()
        time.sleep(0.2)
    return counts


def test_members_sit_on_their_nodes(remote_pair: list[RemoteMember]) -> None:
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for member, resource in zip(remote_pair, NODES):
        assert resource in nodes[member.placed.info["node_id"]]
    assert remote_pair[0].placed.info["node_id"] != remote_pair[1].placed.info["node_id"]
    assert [m.vocab_size for m in remote_pair] == [49152, 262144]


@pytest.mark.parametrize("case", ["safe-unite-d0", "specem", "every-token-unite"])
def test_greedy_outputs_identical_to_local(remote_pair: list[RemoteMember], case: str) -> None:
    """The recorded local outputs (``tests/golden``, which ``test_golden`` checks against the
    local members) come back byte for byte from the actors: no second local run needed."""
    name, method, idx, config = next(c for c in record.CASES if c[0] == case)
    config = {k: v for k, v in config.items() if k != "parallel"}  # members on two nodes: run them in parallel
    got = [record.run_case(remote_pair, method, idx, config, p) for p in record.PROMPTS]
    assert got == RECORDED["cases"][name]
    assert held(remote_pair) == [0, 0]


def test_prompt_lookup_drafts_next_to_the_cache(remote_pair: list[RemoteMember]) -> None:
    """The guesses travel with the draft call: the actors draft the recorded text with them."""
    name, method, idx, config = next(c for c in record.CASES if c[0] == "safe-unite-d0")
    got = [record.run_case(remote_pair, method, idx, {**config, "prompt_lookup": 4}, p) for p in record.PROMPTS]
    assert got == RECORDED["cases"][name]
    assert held(remote_pair) == [0, 0]


def test_streaming_and_adapters(real_pair: list[Member], remote_pair: list[RemoteMember]) -> None:
    from langchain_ensemble import ChatEnsemble
    from llama_index.llms.ensemble import EnsembleLLM

    prompt = PROMPTS[1]
    remote = Ensemble(remote_pair, method="safe", max_new_tokens=TOKENS)
    expected = Ensemble(real_pair, method="safe", max_new_tokens=TOKENS).generate(prompt).text
    stream = remote.stream(prompt)
    chunks = list(stream)
    assert len(chunks) > 1 and "".join(chunks) == stream.result.text == expected
    chat = ChatEnsemble(ensemble=remote)
    assert chat.invoke(prompt).content == expected
    assert "".join(c.content for c in chat.stream(prompt)) == expected
    llms = [EnsembleLLM(members=list(pair), method="safe", max_new_tokens=TOKENS) for pair in (real_pair, remote_pair)]
    assert llms[1].complete(PROMPTS[0]).text == llms[0].complete(PROMPTS[0]).text
    assert held(remote_pair) == [0, 0]


def test_backend_option_and_errors(real_pair: list[Member], remote_pair: list[RemoteMember]) -> None:
    with pytest.raises(ConfigurationError, match="prebuilt"):
        Ensemble([remote_pair[0], real_pair[1]], backend="ray")
    with pytest.raises(ConfigurationError, match="no member runs on Ray"):
        Ensemble(real_pair, ray_options=OPTIONS)
    assert Ensemble(remote_pair, backend="ray").members == remote_pair  # Ray members pass through
    # the same placement is shared (like local weights); close() gives one share back
    with Ensemble([RayMemberSpec(MEMBERS[0], resources={NODES[0]: 1})], method="single", ray_options=OPTIONS) as e:
        assert e.members[0].link is remote_pair[0].link
    assert held(remote_pair[:1]) == [0]  # still alive: the fixture's share remains


def _fail_mid_generation(ensemble: Ensemble, victim: RemoteMember) -> tuple[str, str, str, float]:
    """Kill ``victim``'s actor after the first streamed chunk; return what the typed error said (not the
    error itself: its traceback would keep the failed request, and so its states, alive)."""
    stream = ensemble.stream(PROMPTS[5], max_new_tokens=64)
    first = threading.Event()

    def kill() -> None:
        first.wait()
        ray.kill(victim.link.handle, no_restart=False)

    killer = threading.Thread(target=kill)
    killer.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(MemberUnavailableError) as caught:
            for _ in stream:
                first.set()
                t0 = time.perf_counter()
    finally:
        first.set()
        killer.join()
    error = caught.value
    return error.member, error.node, str(error), time.perf_counter() - t0


def test_actor_killed_mid_generation_raises_then_recovers(real_pair: list[Member], remote_pair: list[RemoteMember]) -> None:
    ensemble = Ensemble(remote_pair, method="safe", max_new_tokens=TOKENS)
    member, node, message, seconds = _fail_mid_generation(ensemble, remote_pair[1])
    print(f"\nkilled member: typed error after {seconds:.2f} s: {message}")
    assert member == MEMBERS[1] and node == remote_pair[1].link.node
    assert "Retry" in message
    gc.collect()  # the failed request's frames are gone: its surviving member's state is freed
    assert held(remote_pair[:1]) == [0]
    t0 = time.perf_counter()
    again = ensemble.generate(PROMPTS[0])  # waits for the restarted actor (it reloads its model)
    print(f"next request after the restart: {time.perf_counter() - t0:.2f} s")
    assert again.text == Ensemble(real_pair, method="safe", max_new_tokens=TOKENS).generate(PROMPTS[0]).text
    assert held(remote_pair) == [0, 0]


def test_no_state_leaks_over_40_requests(remote_pair: list[RemoteMember]) -> None:
    """Held state checked after every request (a leak shows at its first request): 40 cover each prompt and four
    cancellations (100 took 77 s of the suite for the same checks)."""
    ensemble = Ensemble(remote_pair, method="safe", max_new_tokens=4)
    before = [m.actor_rss() for m in remote_pair]
    for i in range(40):
        prompt = SHORT[i % len(SHORT)]
        if i % 10 == 9:  # cancelled after its first chunk
            stream = ensemble.stream(prompt)
            next(stream)
            stream.cancel()
            assert list(stream) == [] or stream.result is not None
            del stream
        else:
            ensemble.generate(prompt)
        assert held(remote_pair) == [0, 0], f"request {i}"
    after = [m.actor_rss() for m in remote_pair]
    for m, b, a in zip(remote_pair, before, after):
        print(f"\n{m.name}: actor RSS {b / 2**20:.1f} MiB before, {a / 2**20:.1f} MiB after 40 requests")


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from ensemble_core.errors import MissingDependencyError
    from ensemble_core.remote.cluster import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an installation without Ray looks like to `import ray`
    with pytest.raises(MissingDependencyError, match=r"pip install 'tokensemble\[ray\]'"):
        import_ray()


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama: Member, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight SmolLM2-shaped model on disk: an actor of it starts in seconds."""
    path = tmp_path_factory.mktemp("ray") / "tiny-llama"
    tiny_llama.model.save_pretrained(path)
    tiny_llama.tokenizer.save_pretrained(path)
    return path


def _tiny_ensemble(path: Path) -> Ensemble:
    # no CPU of its own (the fixture pair holds both nodes' CPUs); no restart: a kill is for good
    member = RayMemberSpec(str(path), num_cpus=0, max_restarts=0)
    return Ensemble([member], method="single", max_new_tokens=3, ray_options=OPTIONS)


def _wait_dead(handle: object) -> None:
    """Until this process's Ray knows the actor is dead (a direct call fails with ``ActorDiedError``)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(handle.held.remote(), timeout=5)
        except ray.exceptions.ActorDiedError:
            return
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "Ray never reported the killed actor dead"
        time.sleep(0.1)


def test_actor_dead_for_good_says_so_and_a_new_ensemble_places_afresh(cluster: Cluster, tiny_dir: Path) -> None:
    with _tiny_ensemble(tiny_dir) as first:
        expected = first.generate("Hi").text
        dead = first.members[0].link
        ray.kill(dead.handle, no_restart=True)
        _wait_dead(dead.handle)
        with _tiny_ensemble(tiny_dir) as second:  # not the dead actor (acquire's probe finds it dead): a fresh one
            assert second.members[0].link is not dead
            assert second.generate("Hi").text == expected
            for _ in range(2):  # the old ensemble keeps the dead actor, and says so every time
                with pytest.raises(MemberUnavailableError) as caught:
                    first.generate("Hi")
                message = str(caught.value)
                assert caught.value.member == "tiny-llama" and "died for good" in message
                assert "Build the Ensemble again" in message and "Retry" not in message and "decoding state" not in message
            print(f"\ndead actor: {message}")
    assert not [p for p in remote_cluster._PLACED.values() if p.spec.source == str(tiny_dir)]  # all released


def test_a_new_ray_session_places_afresh(cluster: Cluster, tiny_dir: Path) -> None:
    """Last in this file: joining the cluster again ends this process's actors (the fixture pair's too)."""
    old = _tiny_ensemble(tiny_dir)
    expected = old.generate("Hi").text
    ray.shutdown()  # without old.close()
    ray.init(address=cluster.address)
    with pytest.raises(MemberUnavailableError, match="earlier Ray session.*Build the Ensemble again"):
        old.generate("Hi")
    with _tiny_ensemble(tiny_dir) as new:
        assert new.members[0].link is not old.members[0].link
        assert new.generate("Hi").text == expected
    old.close()
