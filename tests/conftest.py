import pytest as _pytest_llm

# --- a hermetic host environment for the whole session (owner: tests) ------------------------------
import os as _os
import subprocess as _subprocess


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            _os.environ.pop(k, None)
        else:
            _os.environ[k] = v


@_pytest_llm.fixture(scope="session", autouse=True)
def _no_proxy_for_loopback():
    """Loopback requests never go to a host proxy (urllib honours HTTP(S)_PROXY otherwise)."""
    saved = {k: _os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
    _os.environ["NO_PROXY"] = _os.environ["no_proxy"] = "127.0.0.1,localhost"
    yield
    _restore_env(saved)


@_pytest_llm.fixture(scope="session", autouse=True)
def _hermetic_git(tmp_path_factory: _pytest_llm.TempPathFactory):
    """git reads a temporary global config (an identity, no signing) and no system config."""
    config = tmp_path_factory.mktemp("gitconfig") / "config"
    config.write_text("")
    for key, value in (("user.name", "autoresearch tests"), ("user.email", "tests@autoresearch.invalid"),
                       ("commit.gpgsign", "false")):
        _subprocess.run(["git", "config", "--file", str(config), key, value], check=True)
    saved = {k: _os.environ.get(k) for k in ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM")}
    _os.environ["GIT_CONFIG_GLOBAL"] = str(config)
    _os.environ["GIT_CONFIG_NOSYSTEM"] = "1"
    yield config
    _restore_env(saved)
# --- end hermetic host environment ------------------------------------------------------------------

# the longest test modules go to the xdist workers first (tests/support/module_order.py)
from support.module_order import (  # noqa: E402,F401
    pytest_collection_modifyitems, pytest_runtest_logreport, pytest_sessionfinish)


# --- fake OpenAI server fixture (owner: LLM client; see tests/support/fake_openai.py) ----------------------
import pytest as _pytest_llm

from support.fake_openai import FakeOpenAI as _FakeOpenAI


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


# --- tiny transactions labs (owner: agent; see tests/support/lab.py) -----------------------------
@_pytest_llm.fixture(scope="session")
def lab_template(tmp_path_factory: _pytest_llm.TempPathFactory):
    """The shrunk template lab, built once per session; copy it with the `lab` fixture."""
    from support.lab import make_template

    return make_template(tmp_path_factory.mktemp("template") / "lab")


@_pytest_llm.fixture
def lab(lab_template, tmp_path):
    """A fresh copy of the tiny lab (git repo, dataset prepared, empty store) for one test."""
    from support.lab import copy_lab

    return copy_lab(lab_template, tmp_path / "lab")
# --- end tiny transactions labs ---------------------------------------------------------------------


# --- a routed fake OpenAI server for the agent's tests (owner: agent) -------------------------------
@_pytest_llm.fixture
def llm(monkeypatch: _pytest_llm.MonkeyPatch):
    """A `RoutedOpenAI` server, and this process's environment pointing the loop at it (with a dummy key)."""
    from support.lab import DUMMY_KEY, RoutedOpenAI, llm_env

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("AUTORESEARCH_MODEL", raising=False)
    with RoutedOpenAI(api_key=DUMMY_KEY) as server:
        for k, v in llm_env(server).items():
            monkeypatch.setenv(k, v)
        yield server
# --- end routed fake OpenAI server ------------------------------------------------------------------


# --- a fresh PostgreSQL database per test (the machine's service; CI must have it) ------------------
PG_ADMIN = _os.environ.get("AUTORESEARCH_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@_pytest_llm.fixture
def pg_url():
    """The URL of a fresh PostgreSQL database, dropped after the test."""
    import uuid

    import psycopg

    plain = PG_ADMIN.replace("postgresql+psycopg://", "postgresql://")
    try:
        admin = psycopg.connect(plain, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        if _os.environ.get("CI"):
            _pytest_llm.fail(f"PostgreSQL at {PG_ADMIN} is required in CI: {e}")
        # platform limit: a developer machine without the PostgreSQL service; CI fails above instead
        _pytest_llm.skip(f"platform limit: no PostgreSQL service at {PG_ADMIN}")
    name = "ar_" + uuid.uuid4().hex[:12]
    admin.execute(f"create database {name}")
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    finally:
        admin.execute(f"drop database {name} with (force)")
        admin.close()
