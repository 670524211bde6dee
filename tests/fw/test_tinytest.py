"""The runner checks itself: assertions must fail when they should, or every other test lies."""

import asyncio

import tinytest
from tinytest import AssertionFailure, TestCase


def _fails(check, *args) -> bool:
    try:
        check(*args)
    except AssertionFailure:
        return True
    return False


class AssertionsTest(TestCase):
    def test_failing_assertions_raise(self):
        self.assertTrue(_fails(self.assertEqual, 1, 2))
        self.assertTrue(_fails(self.assertNotEqual, 1, 1))
        self.assertTrue(_fails(self.assertTrue, 0))
        self.assertTrue(_fails(self.assertFalse, "x"))
        self.assertTrue(_fails(self.assertIs, [], []))
        self.assertTrue(_fails(self.assertIsNot, None, None))
        self.assertTrue(_fails(self.assertIsNone, 0))
        self.assertTrue(_fails(self.assertIsNotNone, None))
        self.assertTrue(_fails(self.assertIn, 3, [1, 2]))
        self.assertTrue(_fails(self.assertNotIn, 1, [1, 2]))
        self.assertTrue(_fails(self.assertIsInstance, "1", int))
        self.assertTrue(_fails(self.assertLess, 2, 2))
        self.assertTrue(_fails(self.assertLessEqual, 3, 2))
        self.assertTrue(_fails(self.assertGreater, 2, 2))
        self.assertTrue(_fails(self.fail))

    def test_passing_assertions_do_not_raise(self):
        self.assertFalse(_fails(self.assertEqual, {"a": [1]}, {"a": [1]}))
        self.assertFalse(_fails(self.assertIsInstance, 1, (str, int)))
        self.assertFalse(_fails(self.assertLessEqual, 2, 2))

    def test_message_is_appended(self):
        try:
            self.assertEqual(1, 2, "context")
        except AssertionFailure as error:
            self.assertIn("context", str(error))
            self.assertIn("1 != 2", str(error))
        else:
            raise AssertionError("assertEqual did not fail")

    def test_passing_assertions_never_build_a_message(self):
        unprintable = _Unprintable()
        self.assertEqual(unprintable, unprintable)
        self.assertIn(unprintable, [unprintable])
        self.assertTrue(unprintable)
        self.assertIsNotNone(unprintable)

    def test_any_note_and_long_values_are_fine(self):
        try:
            self.assertEqual("x" * 5000, "y", {"case": 3})
        except AssertionFailure as error:
            self.assertIn("{'case': 3}", str(error))
            self.assertLess(len(str(error)), 1000)
        else:
            raise AssertionError("assertEqual did not fail")


class _Unprintable:
    def __repr__(self):
        raise RuntimeError("repr() must only run when an assertion fails")


class AssertRaisesTest(TestCase):
    def test_context_manager_keeps_the_exception(self):
        with self.assertRaises(KeyError) as context:
            {}["missing"]
        self.assertIsInstance(context.exception, KeyError)

    def test_context_manager_fails_when_nothing_is_raised(self):
        def nothing():
            with self.assertRaises(ValueError):
                pass

        self.assertTrue(_fails(nothing))

    def test_other_exceptions_propagate(self):
        try:
            with self.assertRaises(ValueError):
                raise KeyError("k")
        except KeyError:
            return
        raise AssertionError("KeyError was swallowed")

    def test_call_form(self):
        error = self.assertRaises(ValueError, int, "x")
        self.assertIsInstance(error, ValueError)
        self.assertTrue(_fails(self.assertRaises, ValueError, int, "1"))

    def test_tuple_of_exceptions(self):
        self.assertRaises((KeyError, ValueError), int, "y")


class RunnerTest(TestCase):
    async def test_async_test_bodies_are_awaited(self):
        class Failing(TestCase):
            async def test_late_failure(self):
                await asyncio.sleep(0)
                self.fail("late")

        try:
            await tinytest._run_one(Failing, "test_late_failure")
        except AssertionFailure as error:
            self.assertIn("late", str(error))
            return
        raise AssertionError("an async failure went unnoticed")

    async def test_set_up_and_tear_down_wrap_each_test(self):
        log = []

        class Logged(TestCase):
            def setUp(self):
                log.append("setUp")

            def tearDown(self):
                log.append("tearDown")

            def test_boom(self):
                log.append("test")
                raise RuntimeError("boom")

        self.assertRaises(RuntimeError, lambda: _drive(tinytest._run_one(Logged, "test_boom")))
        self.assertEqual(log, ["setUp", "test", "tearDown"])

    def test_summary_line(self):
        summary = tinytest.Summary()
        summary.passed, summary.failed = 12, 3
        self.assertEqual(summary.line(), "12 passed, 3 failed")

    def test_discovery(self):
        names = tinytest.discover(_HERE)
        self.assertIn("test_tinytest", names)
        self.assertIn("test_mcp_server", names)
        self.assertNotIn("fw_support", names)
        self.assertNotIn("run", names)
        self.assertEqual(names, sorted(names))


def _drive(coroutine):
    """Run a coroutine that never suspends, without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    raise AssertionError("coroutine suspended")


_HERE = tinytest.__file__.rsplit("/", 1)[0] if "/" in tinytest.__file__ else "."
