# --- fake OpenAI server fixture (owner: LLM client; see tests/fake_openai.py) ----------------------
import pytest as _pytest_llm

from fake_openai import FakeOpenAI as _FakeOpenAI


@_pytest_llm.fixture
def fake_openai(monkeypatch: _pytest_llm.MonkeyPatch):
    """A started FakeOpenAI on 127.0.0.1 with an empty script; stopped after the test.

    Proxies are bypassed for 127.0.0.1 so the real SDK talks to it directly on any machine.
    """
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    with _FakeOpenAI() as server:
        yield server
# --- end fake OpenAI server fixture -----------------------------------------------------------------


# --- tiny transactions labs (owner: agent; see tests/agent_fixtures.py) -----------------------------
@_pytest_llm.fixture(scope="session")
def lab_template(tmp_path_factory: _pytest_llm.TempPathFactory):
    """The shrunk template lab, built once per session; copy it with the `lab` fixture."""
    from agent_fixtures import make_template

    return make_template(tmp_path_factory.mktemp("template") / "lab")


@_pytest_llm.fixture
def lab(lab_template, tmp_path):
    """A fresh copy of the tiny lab (git repo, dataset prepared, empty store) for one test."""
    from agent_fixtures import copy_lab

    return copy_lab(lab_template, tmp_path / "lab")
# --- end tiny transactions labs ---------------------------------------------------------------------


# --- a routed fake OpenAI server for the agent's tests (owner: agent) -------------------------------
@_pytest_llm.fixture
def llm(monkeypatch: _pytest_llm.MonkeyPatch):
    """A `RoutedOpenAI` server, and this process's environment pointing the loop at it (with a dummy key)."""
    from agent_fixtures import DUMMY_KEY, RoutedOpenAI, llm_env

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("AUTORESEARCH_MODEL", raising=False)
    with RoutedOpenAI(api_key=DUMMY_KEY) as server:
        for k, v in llm_env(server).items():
            monkeypatch.setenv(k, v)
        yield server
# --- end routed fake OpenAI server ------------------------------------------------------------------
