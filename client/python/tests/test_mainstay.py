"""Tests of the Python module `mainstay`.

Offline: layout helpers. End to end: two trainer ranks (threads) against the fake cluster of
client/src/testing (a real gRPC coordinator and daemons in one process).

    PYTHONPATH=<build>/client/python python3 test_mainstay.py <build>/client/mainstay_client_fake_server
"""
import ctypes
import gc
import json
import subprocess
import sys
import threading
import unittest
import weakref

try:  # the module must load into a process that already has torch (own protobuf, abseil)
    import torch  # noqa: F401
except ImportError:
    pass
import numpy as np

import mainstay

FAKE_SERVER = sys.argv.pop(1) if len(sys.argv) > 1 else None

SPEC = {
    "name": "py-test",
    "data_parallel_size": 2,
    "unreduced_pushes": True,  # step 1 pushes every rank's whole bucket
    "bucket_numel": 4096,
    "overrides": [
        {"pattern": "*.mx.weight", "format": "mxfp8"},
        {"pattern": "*.fp4.weight", "format": "nvfp4"},
        {"pattern": "*.blk.weight", "format": "fp8_block"},
    ],
    "tensors": [
        {"name": "layers.0.mx.weight", "shape": [64, 96]},
        {"name": "layers.0.fp4.weight", "shape": [48, 80]},
        {"name": "layers.0.blk.weight", "shape": [130, 200]},
        {"name": "layers.0.norm.weight", "shape": [100]},
        {"name": "layers.0.bias", "shape": [77]},
    ],
}


def bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(x):
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


class OfflineTest(unittest.TestCase):
    def test_compute_layout_gives_dicts_and_lists(self):
        layout = mainstay.compute_layout(json.dumps(SPEC))
        d = layout.to_dict()
        self.assertEqual(d["data_parallel_size"], 2)
        self.assertEqual(len(d["tensors"]), 5)
        self.assertEqual(layout.tensor("layers.0.mx.weight")["format"], "mxfp8")
        for b in layout.buckets:
            self.assertEqual(len(b["shards"]), 2)
            self.assertEqual(b["numel"], 2 * b["shard_numel"])
        self.assertEqual(mainstay.compute_layout(json.dumps(SPEC), 4).data_parallel_size, 4)

    def test_flatten_unflatten_round_trip_and_padding(self):
        layout = mainstay.compute_layout(json.dumps(SPEC))
        for b in layout.buckets:
            tensors = {layout.tensors[t]["name"]: np.random.rand(*layout.tensors[t]["shape"]).astype(np.float32)
                       for t in b["tensors"]}
            flat = layout.flatten(b["index"], tensors)
            self.assertEqual(flat.shape, (b["numel"],))
            back = layout.unflatten(b["index"], flat)
            for name, value in tensors.items():
                np.testing.assert_array_equal(back[name], value)
            self.assertAlmostEqual(float(np.abs(flat).sum()), float(sum(np.abs(v).sum() for v in tensors.values())),
                                   places=1)
            shard = layout.shard_view(b["index"], 1, flat)
            shard[:] = 0  # a view: writes reach the flat buffer
            self.assertEqual(float(flat[b["shard_numel"]:].sum()), 0.0)

    def test_errors_are_mainstay_errors_with_codes(self):
        with self.assertRaises(mainstay.Error) as e:
            mainstay.compute_layout('{"name": "x", "tensors": [{"name": "a", "shape": [0]}]}')
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("tensors[0].shape[0]", e.exception.message)
        layout = mainstay.compute_layout(json.dumps(SPEC))
        with self.assertRaises(mainstay.Error) as e:
            layout.tensor_index("nope")
        self.assertEqual(e.exception.code, "NOT_FOUND")
        with self.assertRaises(mainstay.Error):
            mainstay.Client("127.0.0.1:1", job_id="j", job_token="t", timeout_s=0.3)


class WrongInterpreterTest(unittest.TestCase):
    """A Python the extension was not built for (another version from pyenv, a venv) gets an
    ImportError naming the interpreter the package was built for and how to run it."""

    def test_the_error_names_the_interpreter_and_the_command(self):
        import glob
        import os
        import tempfile
        package = os.path.dirname(os.path.abspath(mainstay.__file__))
        built = glob.glob(os.path.join(package, "_mainstay*.so"))
        self.assertEqual(len(built), 1, built)
        with tempfile.TemporaryDirectory() as root:
            copy = os.path.join(root, "mainstay")
            os.mkdir(copy)
            for name in ("__init__.py", "_build.py"):
                with open(os.path.join(package, name)) as src, open(os.path.join(copy, name), "w") as dst:
                    dst.write(src.read())
            # The extension as another Python version would find it: under an ABI tag it does not load.
            os.symlink(built[0], os.path.join(copy, "_mainstay.cpython-399-x86_64-linux-gnu.so"))
            r = subprocess.run([sys.executable, "-c", "import mainstay"], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=root), timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError: mainstay: the compiled extension mainstay._mainstay does not load into %s"
                      % sys.executable, r.stderr)
        self.assertIn("was built for %s as _mainstay.cpython-399-x86_64-linux-gnu.so" % sys.executable, r.stderr)
        self.assertIn("PYTHONPATH=%s %s your_script.py" % (root, sys.executable), r.stderr)
        self.assertIn("-DPYTHON_EXECUTABLE=", r.stderr)


@unittest.skipIf(FAKE_SERVER is None, "needs the fake server binary")
class EndToEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = subprocess.Popen([FAKE_SERVER, "2", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
        line = cls.server.stdout.readline().strip()
        assert line.startswith("coordinator="), line
        cls.address = line.split("=", 1)[1]

    @classmethod
    def tearDownClass(cls):
        cls.server.stdin.close()
        cls.server.wait(timeout=30)

    def run_ranks(self, fn, clients):
        results = [None] * len(clients)
        errors = []

        def body(r):
            try:
                results[r] = fn(r, clients[r])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def test_two_ranks_step_loop(self):
        c0 = mainstay.Client(self.address, spec_json=json.dumps(SPEC), rank=0, timeout_s=30)
        c1 = mainstay.Client(self.address, job_id=c0.job_id, job_token=c0.job_token, rank=1, timeout_s=30)
        clients = [c0, c1]
        layout = c0.layout
        self.assertEqual(c1.layout.to_dict(), layout.to_dict())
        self.assertEqual(c1.placement["epoch"], 1)
        rng = np.random.default_rng(0)
        init = {t["name"]: (0.05 * rng.standard_normal(t["shape"])).astype(np.float32) for t in layout.tensors}
        buckets = layout.buckets
        flat_init = [layout.flatten(b["index"], {layout.tensors[t]["name"]: init[layout.tensors[t]["name"]]
                                                  for t in b["tensors"]}) for b in buckets]
        # Version 0: every rank pushes its own shard of the initial parameters.
        for c in clients:
            for b in buckets:
                c.push_initial_params(b["index"], flat_init[b["index"]])
        for b in buckets:
            pulled = c1.pull_bucket(b["index"], 0)
            self.assertEqual(pulled.version, 0)
            self.assertTrue(pulled.complete)
            values = pulled.dequantize_all()
            for name, v in values.items():
                self.assertEqual(v.shape, init[name].shape)
                if layout.tensor(name)["format"] == "bf16":
                    np.testing.assert_array_equal(v, bf16_round(init[name]))
                else:
                    self.assertLess(float(np.abs(v - init[name]).mean()), 0.25 * float(np.abs(init[name]).mean()))
            view = pulled.tensor(pulled.tensors[0])
            self.assertEqual(view["data"].dtype, np.uint8)
            self.assertFalse(view["data"].flags.writeable)
            self.assertTrue(view["complete"])
        mx = c0.pull_bucket(layout.tensor("layers.0.mx.weight")["bucket"], 0).tensor("layers.0.mx.weight")
        self.assertEqual(mx["scales"].shape, (64, 3))  # E8M0 per 1x32 block
        self.assertEqual(mx["data"].size, 64 * 96)
        self.assertGreaterEqual(len(mx["fragments"]), 1)

        # Step 0, reduced: each rank pushes its shard of the reduced gradient, asynchronously.
        grads = [(0.01 * rng.standard_normal(b["numel"])).astype(np.float32) for b in buckets]

        # Rank 1 hands its shards over as CUDA arrays (__cuda_array_interface__, as a CUDA
        # tensor does); here they wrap host memory, which the client reads as such.
        # Rank 0 pushes arrays of its own that only the client keeps alive once pushed: it holds
        # each one until a finish_step called after the push succeeds (FinishStep may push the
        # step again from them), then lets it go.
        def step0(r, c):
            handles = []
            kept = []
            for b in buckets:
                lo, hi = layout.shard_range(b["index"], r)
                shard = grads[b["index"]][lo:hi]
                if r == 0:
                    shard = shard.copy()
                    kept.append(weakref.ref(shard))
                handles.append(c.push_grad(b["index"], 0, CudaArray(shard) if r == 1 else shard))
            del shard
            for h in handles:
                h.wait()
            self.assertTrue(all(h.ready() for h in handles))
            del handles, h  # (a push handle keeps its array too)
            if r == 0:  # a later push lets go of the finished pushes it may: not of these
                with self.assertRaises(mainstay.Error):
                    c.push_grad(99, 0, np.zeros(4, np.float32), wait=True)
            gc.collect()
            self.assertTrue(all(k() is not None for k in kept), "released before finish_step")
            stats = c.finish_step(0, lr=0.5, weight_decay=0.0)
            gc.collect()
            self.assertTrue(all(k() is None for k in kept), "still held after finish_step succeeded")
            return stats

        stats = self.run_ranks(step0, clients)
        for s in stats:
            self.assertEqual(s["version"], 1)
            self.assertFalse(s["skipped"])
        for b in buckets:
            pulled = c0.pull_bucket(b["index"], 1, wait=False).wait()
            expected = layout.unflatten(b["index"], flat_init[b["index"]] - np.float32(0.5) * grads[b["index"]])
            for name, v in pulled.dequantize_all().items():
                if layout.tensor(name)["format"] == "bf16":
                    np.testing.assert_array_equal(v, bf16_round(expected[name]))

        # Step 1, unreduced: each rank pushes its whole bf16 bucket; the daemons sum them.
        def step1(r, c):
            for b in buckets:
                c.push_bucket_unreduced(b["index"], 1, bf16_bits(grads[b["index"]] * (r + 1)), wait=True)
            return c.finish_step(1, lr=0.1, weight_decay=0.0)

        for s in self.run_ranks(step1, clients):
            self.assertEqual(s["version"], 2)
        latest = c1.pull_shard(0, 1, mainstay.Client.LATEST)
        self.assertEqual(latest.version, 2)
        self.assertFalse(latest.complete)

        # pull_shard_into: one shard's packed bytes into the caller's array (a numpy array, or a
        # CUDA array: here one wrapping host memory, so it comes over gRPC as a host pull would).
        for b in buckets:
            want = c1.pull_shard(b["index"], 1, 2)
            for out in (np.zeros(b["shard_bytes"], np.uint8),
                        CudaArray(np.zeros(b["shard_bytes"] // 2, np.uint16), typestr="<u2")):
                got = c1.pull_shard_into(b["index"], 1, 2, out)
                data = out if isinstance(out, np.ndarray) else out.array.view(np.uint8)
                np.testing.assert_array_equal(data, want.data)
                self.assertEqual(got["version"], 2)
                self.assertFalse(got["unchanged"])
                self.assertEqual(len(got["scales"]), want.scale_bytes)
                self.assertEqual([f["tensor"] for f in got["fragments"]],
                                 [f["tensor"] for f in b["shards"][1]["fragments"]])
        # pull_bucket_into: every shard into its slice of one array, the bucket's packed bytes.
        for b in buckets:
            want = c1.pull_bucket(b["index"], 2)
            out = np.zeros(b["bucket_bytes"], np.uint8)
            got = c1.pull_bucket_into(b["index"], 2, out)
            np.testing.assert_array_equal(out, want.data)
            self.assertEqual([s["shard"] for s in got], [0, 1])
            self.assertEqual(sum(len(s["scales"]) for s in got), want.scale_bytes)
        with self.assertRaises(mainstay.Error) as e:
            c1.pull_bucket_into(0, 2, np.zeros(buckets[0]["shard_bytes"], np.uint8))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        with self.assertRaises(mainstay.Error) as e:
            c1.pull_shard_into(0, 1, 2, np.zeros(buckets[0]["shard_bytes"] + 1, np.uint8))
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("bytes of packed", str(e.exception))
        frozen = np.zeros(buckets[0]["shard_bytes"], np.uint8)
        frozen.flags.writeable = False
        for bad, says in [(frozen, "read-only"), (np.zeros(2 * buckets[0]["shard_bytes"], np.uint8)[::2], "C-contiguous"),
                          (bytearray(buckets[0]["shard_bytes"]), "numpy array or a CUDA array"),
                          (np.empty(buckets[0]["shard_bytes"] // 8, object), "plain numbers")]:
            with self.assertRaises(ValueError) as e:
                c1.pull_shard_into(0, 1, 2, bad)
            self.assertIn(says, str(e.exception))
        # Waiting for the CUDA work that uses the destination needs the CUDA driver.
        if not _has_cuda_driver():
            with self.assertRaises(mainstay.Error) as e:
                c1.pull_shard_into(0, 1, 2, np.zeros(buckets[0]["shard_bytes"], np.uint8), cuda_stream=0)
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION")

        with self.assertRaises(mainstay.Error) as e:
            c0.push_grad(99, 2, np.zeros(4, np.float32), wait=True)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        with self.assertRaises(mainstay.Error) as e:
            c0.push_grad(0, 0, grads[0][:buckets[0]["shard_numel"]], wait=True)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertEqual(e.exception.info["committed_step"], 1)

        # A push that names the CUDA work producing its buffer needs the CUDA driver; without
        # one it is refused before anything is sent. A handle must be an int.
        with self.assertRaises(TypeError):
            c0.push_grad(0, 2, grads[0][:buckets[0]["shard_numel"]], cuda_stream="default")
        if not _has_cuda_driver():
            with self.assertRaises(mainstay.Error) as e:
                c0.push_grad(0, 2, grads[0][:buckets[0]["shard_numel"]], wait=True, cuda_stream=0)
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
            self.assertIn("libcuda.so.1", str(e.exception))

        # CUDA arrays: C-contiguous, of a type a push takes, with a stream the interface allows;
        # the stream they name is waited for (which needs the CUDA driver).
        shard = grads[0][:buckets[0]["shard_numel"]]
        for bad, says in [(CudaArray(shard.astype(np.float64), typestr="<f8"), "typestr '<f8'"),
                          (CudaArray(shard, strides=(8,)), "C-contiguous"),
                          (CudaArray(shard, stream=0), "stream 0")]:
            with self.assertRaises(ValueError) as e:
                c0.push_grad(0, 2, bad)
            self.assertIn(says, str(e.exception))
        if not _has_cuda_driver():
            with self.assertRaises(mainstay.Error) as e:
                c0.push_grad(0, 2, CudaArray(shard, stream=1), wait=True)
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
            self.assertIn("libcuda.so.1", str(e.exception))


class CudaArray:
    """Exposes a numpy array through the CUDA Array Interface (version 3), as a CUDA tensor
    does; keeps the array alive."""

    def __init__(self, array, typestr="<f4", strides=None, stream=None):
        self.array = np.ascontiguousarray(array)
        self.__cuda_array_interface__ = {"shape": self.array.shape, "typestr": typestr, "strides": strides,
                                         "data": (self.array.ctypes.data, False), "version": 3, "stream": stream}


def _has_cuda_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    unittest.main(verbosity=2)
