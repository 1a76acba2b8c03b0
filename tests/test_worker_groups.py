"""Which tests share a worker under `--dist loadgroup` (tests/conftest.py): those that share a fixture made once."""

from types import SimpleNamespace

from tests.conftest import one_thread_per_process, slow_modules_first, xdist_group


def item(nodeid, slow=False, marks=(), **scopes):
    """A collected test using fixtures of the given scopes (name=scope), marked slow or not, and with `marks`."""
    definitions = {name: [SimpleNamespace(scope=scope)] for name, scope in scopes.items()}
    return SimpleNamespace(
        nodeid=nodeid,
        fixturenames=list(scopes),
        _fixtureinfo=SimpleNamespace(name2fixturedefs=definitions),
        get_closest_marker=lambda name: object() if (slow and name == "slow") or name in marks else None,
    )


def test_modules_with_a_slow_test_go_first_and_each_module_stays_together_in_order():
    """Moved apart, a module's tests would tear down and make its module-scoped fixtures again."""
    items = [
        item("tests/a/test_quick.py::test_1"),
        item("tests/e2e/test_run.py::test_fast_check"),
        item("tests/e2e/test_run.py::test_whole_run", slow=True),
        item("tests/z/test_quick.py::test_2"),
        item("tests/z/test_long.py::test_3", slow=True),
    ]
    order = [i.nodeid for i in slow_modules_first(items)]
    assert order == [
        "tests/e2e/test_run.py::test_fast_check",
        "tests/e2e/test_run.py::test_whole_run",
        "tests/z/test_long.py::test_3",
        "tests/a/test_quick.py::test_1",
        "tests/z/test_quick.py::test_2",
    ]


def test_tests_sharing_a_module_or_class_fixture_share_a_worker_and_the_rest_go_free():
    assert xdist_group(item("tests/e2e/test_a.py::test_one", trained_run="module")) == "tests/e2e/test_a.py"
    assert xdist_group(item("tests/e2e/test_a.py::T::test_two", engine="class", tmp_path="function")) == (
        "tests/e2e/test_a.py"
    )
    # whole runs that share nothing may run on both workers at once
    assert xdist_group(item("tests/e2e/test_a.py::test_three", tmp_path="function", tiny_checkpoint="session")) is None
    assert xdist_group(item("tests/e2e/test_a.py::test_four")) is None
    # the session's SGLang engine: one group across modules, so one engine
    assert xdist_group(item("tests/x/test_b.py::test_five", sglang_engine="session")) == "session-engine"
    # and the session's Qwen3 engine beside it: one start for the suite, not one per module that uses it
    assert xdist_group(item("tests/x/test_b.py::test_qwen3", sglang_qwen3_engine="session")) == "session-engine"
    # a parametrized fixture that asks for it at run time marks that case; its other cases keep the module's group
    case = item("tests/x/test_c.py::test_six[sglang]", marks=("session_engine",), cpu_engine_url="module")
    assert xdist_group(case) == "session-engine"
    assert xdist_group(item("tests/x/test_c.py::test_six[cpu]", cpu_engine_url="module")) == "tests/x/test_c.py"


def test_tests_sharing_a_package_fixture_share_a_worker_across_the_packages_modules():
    """A package-scoped fixture (a prepared miniature) is made once per worker: its tests, in any of the package's
    modules, go to one worker, whatever other fixtures they use."""

    def uses_package_fixture(nodeid, **scopes):
        test = item(nodeid, **scopes)
        test._fixtureinfo.name2fixturedefs["prepared"] = [SimpleNamespace(scope="package", baseid="tests/benchmarks")]
        test.fixturenames.append("prepared")
        return test

    first = uses_package_fixture("tests/benchmarks/test_a.py::test_one", tmp_path="function")
    second = uses_package_fixture("tests/benchmarks/test_b.py::test_two", engine="module")
    assert xdist_group(first) == xdist_group(second) == "package:tests/benchmarks"


def test_an_overridden_fixture_counts_with_the_scope_of_the_definition_the_test_gets():
    """pytest lists a name's definitions outermost first; the test gets the last one."""
    overridden = item("tests/test_c.py::test_six", run="function")
    overridden._fixtureinfo.name2fixturedefs["run"] = [
        SimpleNamespace(scope="module"),
        SimpleNamespace(scope="function"),
    ]
    assert xdist_group(overridden) is None


def test_every_session_scoped_engine_fixture_groups_its_tests():
    """A session-scoped server outside SESSION_ENGINE_FIXTURES would start once on each worker that uses it."""
    import inspect

    import tests.conftest as conftest

    servers = {
        name
        for name, value in vars(conftest).items()
        if name.endswith("_engine") and 'scope="session"' in inspect.getsource(value)
    }
    assert servers == conftest.SESSION_ENGINE_FIXTURES


def test_each_process_of_a_parallel_suite_gets_one_thread_unless_the_caller_chose():
    environ = {}
    one_thread_per_process(environ)
    assert environ == {"OMP_NUM_THREADS": "1"}
    chosen = {"OMP_NUM_THREADS": "4"}
    one_thread_per_process(chosen)
    assert chosen == {"OMP_NUM_THREADS": "4"}
