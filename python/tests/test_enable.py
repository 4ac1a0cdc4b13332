#!/usr/bin/env python3
"""`pinpool_torch.enable()` works fully or raises, checked without a GPU and without
PyTorch: a stand-in `torch` module records what enable() hands it, and the library is the
build without CUDA support ($PINPOOL_TORCH_TEST_LIB, or target/debug's, which the tests
bring up to date with `cargo build -p pinpool-torch` first).

    python3 python/tests/test_enable.py
"""

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

GRAPH_HOOKS = ("set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool")
OTHER_HOOKS = ("set_record_stream_fn", "set_reset_fn", "set_memory_fraction_fn")


def test_library():
    return os.environ.get("PINPOOL_TORCH_TEST_LIB") or os.path.join(
        ROOT, "target", "debug", "libpinpool_torch.so"
    )


def setUpModule():
    # target/debug's library is whichever build ran last (a wheel's build has CUDA support):
    # the build without it again, quick when nothing changed.
    if not os.environ.get("PINPOOL_TORCH_TEST_LIB") and shutil.which("cargo"):
        subprocess.run(["cargo", "build", "-q", "-p", "pinpool-torch"], cwd=ROOT, check=True)


class FakeTorch:
    """A stand-in `torch` with the few calls enable() makes; records them."""

    def __init__(self, hooks=GRAPH_HOOKS + OTHER_HOOKS):
        self.installed = []
        self.set = {}
        fake = self

        class Hooks:
            pass

        for name in hooks:
            setattr(Hooks, name, lambda self, value, name=name: fake.set.__setitem__(name, value))

        class Pluggable:
            def __init__(self, path, alloc, free):
                self.path, self.names = path, (alloc, free)
                self.hooks = Hooks()

            def allocator(self):
                return self.hooks

        torch = types.ModuleType("torch")
        torch.__version__ = "0.0-test"
        torch.cuda = types.ModuleType("torch.cuda")
        torch.cuda.is_initialized = lambda: False
        torch.cuda.memory = types.ModuleType("torch.cuda.memory")
        torch.cuda.memory.CUDAPluggableAllocator = Pluggable
        torch.cuda.memory.change_current_allocator = self.installed.append
        self.module = torch


class EnableTest(unittest.TestCase):
    def setUp(self):
        self.env = dict(os.environ)
        self.cache = tempfile.mkdtemp()
        os.environ["PINPOOL_TORCH_CACHE"] = self.cache
        os.environ.pop("PINPOOL_TORCH_LIB", None)
        self.torch = FakeTorch()
        sys.modules["torch"] = self.torch.module
        sys.modules.pop("pinpool_torch", None)
        self.pt = importlib.import_module("pinpool_torch")

    def tearDown(self):
        os.environ.clear()
        os.environ.update(self.env)
        sys.modules.pop("torch", None)
        sys.modules.pop("pinpool_torch", None)

    def need_library(self):
        if not os.path.isfile(test_library()):
            self.skipTest(f"no {test_library()}: run `cargo build -p pinpool-torch` first")
        return test_library()

    def assert_not_installed(self):
        self.assertEqual(self.torch.installed, [], "PyTorch's allocator was replaced")
        self.assertFalse(self.pt.enabled())

    def test_a_library_path_that_names_no_file_is_an_error_naming_it(self):
        os.environ["PINPOOL_TORCH_LIB"] = "/nonexistent/libpinpool_torch.so"
        with self.assertRaises(self.pt.LibraryError) as e:
            self.pt.enable()
        self.assertIn("/nonexistent/libpinpool_torch.so", str(e.exception))
        self.assertIn("PINPOOL_TORCH_LIB", str(e.exception))
        self.assert_not_installed()

    def test_a_file_that_is_not_a_library_is_an_error_naming_it(self):
        path = os.path.join(self.cache, "not-a-library.so")
        with open(path, "w") as f:
            f.write("not ELF")
        with self.assertRaises(self.pt.LibraryError) as e:
            self.pt.enable(path)
        self.assertIn(path, str(e.exception))
        self.assert_not_installed()

    def test_without_a_shim_enable_raises_instead_of_falling_back(self):
        lib = self.need_library()
        os.environ["CXX"] = "/bin/false"
        with self.assertRaises(RuntimeError) as e:
            self.pt.enable(lib)
        self.assertIn("shim", str(e.exception))
        self.assert_not_installed()

    def test_a_pytorch_without_the_graph_pool_hooks_is_refused(self):
        lib = self.need_library()
        self.torch = FakeTorch(hooks=OTHER_HOOKS)
        sys.modules["torch"] = self.torch.module
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.assertRaises(RuntimeError) as e:
                self.pt.enable(lib)
        self.assertIn("set_begin_allocate_to_pool", str(e.exception))
        self.assert_not_installed()

    def test_a_library_built_without_cuda_is_refused(self):
        lib = self.need_library()
        self.assertFalse(self.pt.cuda_support(lib))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.assertRaises(RuntimeError) as e:
                self.pt.enable(lib)
        self.assertIn("without CUDA support", str(e.exception))
        self.assertIn(lib, str(e.exception))
        self.assert_not_installed()

    def test_an_unknown_setting_is_a_value_error_naming_the_valid_keys(self):
        lib = self.need_library()
        with self.assertRaises(ValueError) as e:
            self.pt.enable(lib, expandable_segment=False)
        self.assertIn("expandable_segment", str(e.exception))
        self.assertIn("valid keys", str(e.exception))
        self.assertIn("roundup_power2_divisions", str(e.exception))
        self.assert_not_installed()
        os.environ["PINPOOL_DEVICE_CONF"] = "thread_cache:8"
        with self.assertRaises(ValueError):
            self.pt.settings(lib)

    def test_settings_set_only_their_keys_over_the_variable_and_the_defaults(self):
        lib = self.need_library()
        os.environ["PINPOOL_DEVICE_CONF"] = "expandable_segments:false, thread_cache_mb:8, reserve_cap:1.1"
        self.pt._apply_settings({"thread_cache_mb": 32, "roundup_power2_divisions": {256: 1, ">": 4}})
        got = self.pt.settings(lib)
        for part in ("expandable_segments:false", "thread_cache_mb:32", "reserve_cap:1.1", "[256:1,>:4]"):
            self.assertIn(part, got)


class CudaHeaders(unittest.TestCase):
    """Where the allocator front finds CUDA's headers: a toolkit's, else those of PyTorch's
    pip dependencies (site-packages/nvidia/*/include)."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        import pinpool_torch

        self.find = pinpool_torch._cuda_include_dirs

    def tearDown(self):
        shutil.rmtree(self.dir)

    def touch(self, *parts):
        path = os.path.join(self.dir, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
        return path

    def test_a_toolkit_named_by_cuda_home_is_used(self):
        self.touch("cuda", "include", "cuda_runtime_api.h")
        self.touch("site", "nvidia", "cu13", "include", "cuda_runtime_api.h")
        found = self.find(os.path.join(self.dir, "cuda"), [os.path.join(self.dir, "site")])
        self.assertEqual(found, [os.path.join(self.dir, "cuda", "include")])

    def test_without_a_toolkit_the_pip_wheels_headers_are_used(self):
        self.touch("site", "nvidia", "cuda_runtime", "include", "cuda_runtime_api.h")
        self.touch("site", "nvidia", "cuda_crt", "include", "crt", "host_defines.h")
        self.touch("site", "nvidia", "cublas", "include", "cublas.h")
        found = self.find(None, [os.path.join(self.dir, "site")])
        inc = lambda name: os.path.join(self.dir, "site", "nvidia", name, "include")
        self.assertEqual(found, [inc("cuda_crt"), inc("cuda_runtime")])

    def test_without_the_crt_headers_pinpools_host_only_stand_ins_complete_them(self):
        self.touch("site", "nvidia", "cu13", "include", "cuda_runtime_api.h")
        found = self.find(None, [os.path.join(self.dir, "site")])
        self.assertEqual(found[0], os.path.join(self.dir, "site", "nvidia", "cu13", "include"))
        self.assertEqual(len(found), 2)
        for header in ("host_defines.h", "host_config.h"):
            self.assertTrue(os.path.isfile(os.path.join(found[1], "crt", header)), header)

    def test_without_the_runtime_headers_the_front_is_refused_naming_what_is_missing(self):
        self.touch("site", "nvidia", "cublas", "include", "cublas.h")
        with self.assertRaisesRegex(RuntimeError, "cuda_runtime_api.h"):
            self.find(None, [os.path.join(self.dir, "site")])

if __name__ == "__main__":
    unittest.main(verbosity=2)
