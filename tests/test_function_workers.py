"""Worker processes that call code we do not control (`dagster_rl.runtime.function_workers`): a result
comes back as the callable returned it, an error names where it was raised, a call past its deadline
has its worker killed (and the next call gets a fresh one), a worker that dies is named, a file
whose bytes changed since they were hashed is refused, and what the callable prints is not the
protocol's. No model, no Dagster."""

import hashlib
import threading
import time

import psutil
import pytest

from dagster_rl.runtime.function_workers import Callee, FunctionFailed, FunctionWorkers

CODE = """\
import os, sys, time

def add(a, b):
    print("printed by the callable")  # goes to stderr, not into the protocol
    return a + b

def raises(**kwargs):
    return {}["missing"]

def hangs(**kwargs):
    while True:
        pass

def sleeps(seconds):
    time.sleep(seconds)
    return seconds

def exits(**kwargs):
    os._exit(3)

def numbers(**kwargs):
    return [float("nan"), float("inf"), 0.1, None, True]

def pid(**kwargs):
    return os.getpid()

def child(**kwargs):
    import subprocess
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
"""
NAMES = ("add", "raises", "hangs", "sleeps", "exits", "numbers", "pid", "child")


def _pool(folder, size: int = 1) -> FunctionWorkers:
    path = folder / "calls.py"
    path.write_text(CODE)
    digest = hashlib.sha256(CODE.encode()).hexdigest()
    return FunctionWorkers([Callee(f"calls.py:{n}", str(folder), digest) for n in NAMES], size=size)


@pytest.fixture
def pool(tmp_path):
    workers = _pool(tmp_path)
    yield workers
    workers.close()


def call(pool: FunctionWorkers, name: str, timeout_s: float = 30.0, **kwargs):
    return pool.call(NAMES.index(name), kwargs, timeout_s)


def test_a_result_comes_back_as_returned_and_one_worker_serves_call_after_call(pool, capfd):
    assert call(pool, "add", a=0.1, b=0.2) == 0.1 + 0.2
    assert call(pool, "add", a=[1], b=[2]) == [1, 2]
    nan, inf, tenth, none, true = call(pool, "numbers")
    assert nan != nan and inf == float("inf") and tenth == 0.1 and none is None and true is True  # the caller refuses them
    assert pool.started == 1
    assert "printed by the callable" in capfd.readouterr().err


def test_an_error_names_its_type_message_and_line(pool):
    with pytest.raises(FunctionFailed) as raised:
        call(pool, "raises")
    assert raised.value.how == "raised"
    assert raised.value.detail == "KeyError: 'missing' (calls.py, line 8, in raises)"
    assert call(pool, "add", a=1, b=2) == 3 and pool.started == 1  # the worker lives on


def test_a_call_past_its_deadline_kills_its_worker_and_the_next_call_gets_another(pool):
    first = call(pool, "pid")
    start = time.monotonic()
    with pytest.raises(FunctionFailed) as raised:
        call(pool, "hangs", timeout_s=1.0)
    assert raised.value.how == "timeout" and raised.value.detail == "did not return within 1 s"
    assert time.monotonic() - start < 10
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    assert call(pool, "pid") != first and pool.started == 2


def test_a_timeout_kills_what_the_callable_started(pool):
    assert call(pool, "sleeps", seconds=0.1) == 0.1
    grandchild = call(pool, "child")  # a process the worker started, still running
    with pytest.raises(FunctionFailed):
        call(pool, "hangs", timeout_s=0.5)
    time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_a_worker_that_dies_mid_call_is_named_and_replaced(pool):
    with pytest.raises(FunctionFailed) as raised:
        call(pool, "exits")
    assert raised.value.how == "died" and raised.value.detail == "its worker process exited with status 3 during the call"
    assert call(pool, "add", a=1, b=1) == 2


def test_a_file_whose_bytes_changed_since_they_were_hashed_is_refused(tmp_path):
    pool = _pool(tmp_path)
    (tmp_path / "calls.py").write_text(CODE + "\n# edited\n")
    with pytest.raises(FunctionFailed) as raised:
        call(pool, "add", a=1, b=1)
    pool.close()
    assert (
        raised.value.how == "load" and "calls.py:add: the file changed since this step computed its keys" in raised.value.detail
    )


def test_a_hung_call_holds_one_worker_while_another_serves(tmp_path):
    pool = _pool(tmp_path, size=2)
    outcome = {}

    def hang():
        try:
            call(pool, "hangs", timeout_s=3.0)
        except FunctionFailed as e:
            outcome["hung"] = e.how

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    assert call(pool, "add", a=2, b=2) == 4
    assert time.monotonic() - start < 2.5  # not behind the hung call
    thread.join()
    pool.close()
    assert outcome == {"hung": "timeout"}


def test_an_idle_worker_exits_and_a_call_after_it_starts_a_fresh_one(tmp_path):
    path = tmp_path / "calls.py"
    path.write_text(CODE)
    pool = FunctionWorkers([Callee("calls.py:pid", str(tmp_path))], size=1, idle_timeout_s=0.5)
    first = pool.call(0, {}, 10)
    time.sleep(2.0)
    second = pool.call(0, {}, 10)
    pool.close()
    assert first != second and pool.started == 2


def test_a_file_that_raises_as_it_is_imported_is_a_load_failure_naming_it(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n\ndef f():\n    return 1\n")
    pool = FunctionWorkers([Callee("broken.py:f", str(tmp_path))], size=1)
    with pytest.raises(FunctionFailed) as raised:
        pool.call(0, {}, 10)
    pool.close()
    assert raised.value.how == "load"
    assert (
        "broken.py raised while it was imported: ModuleNotFoundError: No module named 'no_such_module_here'"
        in raised.value.detail
    )
