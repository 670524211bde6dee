"""A tiny unittest-like runner that works unchanged on CPython, the MicroPython unix port and the
MicroPython WebAssembly port (which has no asyncio.run, so the runner itself is a coroutine).

Test classes subclass TestCase; every `test*` method runs on a fresh instance after setUp and
before tearDown. `async def` tests are awaited. No skips: every runtime must run every test.
"""

import os
import sys

try:
    from sys import print_exception  # MicroPython
except ImportError:
    from traceback import print_exception


_NOTHING = object()
_REPR_LIMIT = 300


class AssertionFailure(AssertionError):
    pass


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


class _RaisesContext:
    def __init__(self, expected):
        self.expected = expected
        self.exception = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is None:
            raise AssertionFailure(_name(self.expected) + " not raised")
        if not issubclass(exc_type, self.expected):
            return False  # let the unexpected exception propagate as an error
        self.exception = exc_value
        return True


def _name(expected) -> str:
    if isinstance(expected, tuple):
        return " or ".join(_name(kind) for kind in expected)
    return expected.__name__


class TestCase:
    def setUp(self):
        pass

    def tearDown(self):
        pass

    def fail(self, message="failed"):
        raise AssertionFailure(message)

    def _check(self, condition, first, relation, second=_NOTHING, note=None):
        # The message is built only on failure: repr() of a big buffer can exhaust the heap.
        if condition:
            return
        message = _short(first) + " " + relation
        if second is not _NOTHING:
            message += " " + _short(second)
        if note is not None:
            message += ": " + str(note)
        raise AssertionFailure(message)

    def assertEqual(self, first, second, msg=None):
        self._check(first == second, first, "!=", second, msg)

    def assertNotEqual(self, first, second, msg=None):
        self._check(first != second, first, "==", second, msg)

    def assertTrue(self, value, msg=None):
        self._check(bool(value), value, "is not true", note=msg)

    def assertFalse(self, value, msg=None):
        self._check(not value, value, "is not false", note=msg)

    def assertIs(self, first, second, msg=None):
        self._check(first is second, first, "is not", second, msg)

    def assertIsNot(self, first, second, msg=None):
        self._check(first is not second, first, "is", second, msg)

    def assertIsNone(self, value, msg=None):
        self._check(value is None, value, "is not None", note=msg)

    def assertIsNotNone(self, value, msg=None):
        self._check(value is not None, value, "is None", note=msg)

    def assertIn(self, member, container, msg=None):
        self._check(member in container, member, "not in", container, msg)

    def assertNotIn(self, member, container, msg=None):
        self._check(member not in container, member, "in", container, msg)

    def assertIsInstance(self, value, kind, msg=None):
        self._check(isinstance(value, kind), value, "is not a " + _name(kind), note=msg)

    def assertLess(self, first, second, msg=None):
        self._check(first < second, first, "not <", second, msg)

    def assertLessEqual(self, first, second, msg=None):
        self._check(first <= second, first, "not <=", second, msg)

    def assertGreater(self, first, second, msg=None):
        self._check(first > second, first, "not >", second, msg)

    def assertRaises(self, expected, *call_and_args, **kwargs):
        """Context manager (`with self.assertRaises(E) as ctx:`) or call form."""
        context = _RaisesContext(expected)
        if not call_and_args:
            return context
        function = call_and_args[0]
        with context:
            function(*call_and_args[1:], **kwargs)
        return context.exception


class Summary:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.failures = []

    def line(self) -> str:
        return str(self.passed) + " passed, " + str(self.failed) + " failed"


def discover(directory) -> list:
    """Sorted module names of test_*.py files in directory."""
    names = [name[:-3] for name in os.listdir(directory) if _is_test_file(name)]
    names.sort()
    return names


def _is_test_file(name) -> bool:
    return name.startswith("test_") and name.endswith(".py")


def _test_classes(module) -> list:
    classes = []
    for attribute in sorted(dir(module)):
        value = getattr(module, attribute)
        if isinstance(value, type) and issubclass(value, TestCase) and value is not TestCase:
            classes.append(value)
    return classes


def _test_methods(cls) -> list:
    return sorted(
        name for name in dir(cls) if name.startswith("test") and callable(getattr(cls, name))
    )


async def _run_one(cls, method_name):
    case = cls()
    case.setUp()
    try:
        outcome = getattr(case, method_name)()
        if hasattr(outcome, "send"):  # an `async def` test
            await outcome
    finally:
        case.tearDown()


def _report(summary, label, error):
    summary.failed += 1
    summary.failures.append(label)
    kind = "FAIL" if isinstance(error, AssertionError) else "ERROR"
    print(kind + ": " + label)
    print_exception(error)


async def run_module(module_name, summary):
    try:
        module = __import__(module_name)
    except Exception as error:  # a broken test module counts as one failure
        _report(summary, module_name + " (import)", error)
        return
    for cls in _test_classes(module):
        for method_name in _test_methods(cls):
            label = module_name + "." + cls.__name__ + "." + method_name
            try:
                await _run_one(cls, method_name)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:  # e.g. a stray CancelledError fails only its test
                _report(summary, label, error)
            else:
                summary.passed += 1


async def main(directory=".", modules=None) -> Summary:
    """Run the given test modules (default: all of directory) and print the summary line."""
    if directory not in sys.path:
        sys.path.insert(0, directory)
    summary = Summary()
    for module_name in modules or discover(directory):
        await run_module(module_name, summary)
    print(summary.line())
    return summary
