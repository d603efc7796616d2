"""The chart's drain on GPU-pod termination (issue 29 item 3): the agent's preStop runs
``fairbatch-agent drain --wait``, the vLLM container's preStop waits for the agent to be gone, and the
pod's grace period covers the drain (helpers and the helm fixture of tests/deploy/test_helm.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.deploy.test_helm import CHART, KUBE_VERSION, NAMESPACE, RELEASE, _run, container, helm, one, render

__all__ = ["helm"]  # the session fixture, imported so pytest finds it here

STS = f"{RELEASE}-fairbatch-vllm"


def _pod(objs: list[dict]) -> dict:
    return one(objs, "StatefulSet", STS)["spec"]["template"]["spec"]


def _args_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_default_drain_hooks_and_grace_period(helm: Path) -> None:
    pod = _pod(render(helm))
    agent = container(pod, "agent")
    # the defaults: grace 60 s, hand-over bound 5 s -> the drain's bound 60 + 5 + 10 = 75 s
    assert _args_value(agent["args"], "--drain-grace-s") == "60"
    assert _args_value(agent["args"], "--drain-handover-s") == "5"
    hook = agent["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["fairbatch-agent", "drain", "--url", "http://127.0.0.1:8001", "--wait", "--timeout-s", "75"]
    assert pod["terminationGracePeriodSeconds"] >= 75
    vllm_hook = container(pod, "vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert vllm_hook[:2] == ["python3", "-c"]
    assert '("127.0.0.1", 8001)' in vllm_hook[2] and "+ 75" in vllm_hook[2]


def test_vllm_hook_returns_once_nothing_listens(helm: Path) -> None:
    """The vLLM container's hook script, run here: with nothing on the agent port it returns at once."""
    pod = _pod(render(helm, set_=("agent.httpPort=1",)))  # port 1: nothing listens there
    script = container(pod, "vllm")["lifecycle"]["preStop"]["exec"]["command"][2]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr


def test_drain_off_renders_no_hooks(helm: Path) -> None:
    pod = _pod(render(helm, set_=("agent.drain.enabled=false",)))
    assert "lifecycle" not in container(pod, "agent") and "lifecycle" not in container(pod, "vllm")


def test_grace_period_shorter_than_the_drain_is_refused(helm: Path) -> None:
    # 100 + 5 + 10 = 115 > 110
    proc = _run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                "--set", "agent.drain.graceSeconds=100", "--set", "vllm.terminationGracePeriodSeconds=110")
    assert proc.returncode != 0
    assert "vllm.terminationGracePeriodSeconds (110) must be at least" in proc.stderr and "(115)" in proc.stderr
    ok = render(helm, set_=("agent.drain.graceSeconds=100", "vllm.terminationGracePeriodSeconds=115"))
    assert _pod(ok)["terminationGracePeriodSeconds"] == 115
