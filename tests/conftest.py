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
