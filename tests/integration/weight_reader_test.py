"""Weight serving through the real binaries (issue 23; docs/weight_serving.md): a reader process
with the job's reader token polls for new versions while two trainers train, and every version
it reads equals, byte for byte, what the trainers pulled for that version; its fp32 tensors
equal the trainers' dequantized parameters, and its published tensors decode to them by the
documented conventions. The reader token reads nothing of another job, cannot push or finish
a step, and a rotation (mainstayctl jobs reader-token --rotate) cuts off the old token.

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... \\
    PYTHONPATH=<build>/client/python /usr/bin/python3 weight_reader_test.py
"""
import json
import os
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
import process_cluster  # noqa: E402  (the shared process harness)

import mainstay  # noqa: E402

STEPS = 6
SIDE = 512  # multiples of 128 (fp8_block tiles), 32 (mxfp8) and 16 (nvfp4); 1 MiB per FP32 tensor


def spec(name, recipe):
    return {
        "name": name,
        "recipe": recipe,
        "recipe_options": {"first_last_layers_bf16": False},
        "data_parallel_size": 2,
        "bucket_numel": 2 * SIDE * SIDE,
        "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "max_grad_norm": 0.0},
        "tensors": [{"name": "layers.0.attn.qkv.weight", "shape": [SIDE, SIDE]},
                    {"name": "layers.0.norm.weight", "shape": [SIDE]},
                    {"name": "layers.1.mlp.fc1.weight", "shape": [SIDE, SIDE]},
                    {"name": "layers.1.mlp.fc2.weight", "shape": [SIDE, SIDE]}],
    }


def e4m3_table():
    out = np.zeros(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 7
        if exp == 15 and man == 7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man / 8.0 * 2.0 ** -6
        else:
            out[b] = sign * (1 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def decode_published(fmt, items, name):
    """The documented conventions of docs/weight_serving.md, applied with numpy only."""
    data = np.asarray(items[name])
    if fmt == "bf16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if fmt.startswith("fp8_e4m3"):
        return E4M3[data] * np.float32(np.asarray(items[name + "_scale_inv"]))
    if fmt == "fp8_block":
        grid = np.asarray(items[name + "_scale_inv"])
        return E4M3[data] * np.repeat(np.repeat(grid, 128, axis=0), 128, axis=1)[:data.shape[0], :data.shape[1]]
    if fmt == "mxfp8":
        e = np.asarray(items[name + "_scale"]).astype(np.int32)
        return E4M3[data] * np.repeat(np.ldexp(np.float32(1), e - 127).astype(np.float32), 32, axis=1)
    if fmt == "nvfp4":
        codes = np.empty(data.shape[:-1] + (data.shape[-1] * 2,), dtype=np.uint8)
        codes[..., 0::2] = data & 0xF
        codes[..., 1::2] = data >> 4
        tile = E4M3[np.asarray(items[name + "_scale"])]
        return (E2M1[codes] * np.repeat(tile, 16, axis=1) * np.float32(np.asarray(items[name + "_scale_2"]))).astype(
            np.float32)
    raise AssertionError("no convention for " + fmt)


def as_numpy(t):
    if hasattr(t, "numpy"):
        import torch
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if t.dtype == torch.float16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return t


def load_safetensors(path):
    """{name: (dtype, array)} of a safetensors file, read with json and numpy alone."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    kinds = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
             "U8": np.uint8}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        out[name] = (t["dtype"], np.frombuffer(data[begin:end], dtype=kinds[t["dtype"]]).reshape(t["shape"]))
    assert sum(a.nbytes for _, a in out.values()) == len(data), "the files' tensors cover their data exactly"
    return header["__metadata__"], out


def run_reader(address, job_id, token, out_dir, last_version):
    """The reader process: reads every version it sees until `last_version`, saving each."""
    reader = mainstay.WeightReader(address, job_id, token, timeout_s=60)
    version = 0
    while version < last_version:
        if reader.wait_newer(version, timeout_s=60) is None:
            raise SystemExit("no version after %d within 60 s" % version)
        # The newest (pinned while it is read: training goes on meanwhile), then the same
        # version again pinned by the reader, as fp32.
        published = {n: as_numpy(t) for n, t in reader.tensors(as_="published")}
        version = reader.version
        reader.pin(version)
        fp32 = {n: as_numpy(t) for n, t in reader.tensors(version, as_="fp32")}
        bf16 = {n: as_numpy(t) for n, t in reader.tensors(version, as_="bf16")}
        reader.unpin(version)
        np.savez(os.path.join(out_dir, "v%d.npz" % version), **{"p:" + k: v for k, v in published.items()},
                 **{"f:" + k: v for k, v in fp32.items()}, **{"b:" + k: v for k, v in bf16.items()})
    print("reader read up to version %d, %d bytes" % (version, reader.bytes_read), flush=True)


class WeightReaderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = process_cluster.Cluster(daemons=2, lease_ms=3000)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def fail_with_logs(self, message):
        self.fail(message + "\n" + self.cluster.logs())

    def check_recipe(self, recipe):
        out_dir = os.path.join(self.cluster.dir, "read-" + recipe)
        os.makedirs(out_dir)
        # The launcher asks for the reader token and hands it to the reader before training.
        layout_spec = spec("reader-" + recipe, recipe)
        c0 = mainstay.Client(self.cluster.address, spec_json=json.dumps(layout_spec), rank=0, timeout_s=120)
        token = c0.get_reader_token()
        self.assertEqual(c0.get_reader_token(), token)
        reader = subprocess.Popen([sys.executable, __file__, "--reader", self.cluster.address, c0.job_id, token,
                                   out_dir, str(STEPS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        c1 = mainstay.Client(self.cluster.address, job_id=c0.job_id, job_token=c0.job_token, rank=1, timeout_s=120)
        clients = [c0, c1]
        layout = c0.layout
        tensors = layout.tensors
        rng = np.random.default_rng(7)
        for b in range(len(layout.buckets)):
            c0.push_initial_params(b, rng.standard_normal(layout.buckets[b]["numel"]).astype(np.float32) * 0.1,
                                   all_shards=True, wait=True)
        pulled = {}
        for step in range(STEPS):
            errors = []

            def rank(r, step=step):
                try:
                    c = clients[r]
                    for b in range(len(layout.buckets)):
                        g = np.random.default_rng(step * 10 + r).standard_normal(
                            layout.buckets[b]["shard_numel"]).astype(np.float32)
                        c.push_grad(b, step, g * 0.01, wait=True)
                    c.finish_step(step, lr=1e-2, weight_decay=0.0)
                except Exception as e:  # noqa: BLE001 (reported below)
                    errors.append(e)
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                self.fail_with_logs("step %d: %r" % (step, errors))
            got = {}
            for b in range(len(layout.buckets)):
                p = c0.pull_bucket(b, step + 1)
                for i, t in enumerate(tensors):
                    if t["bucket"] == b:
                        view = p.tensor(i)
                        got[t["name"]] = (bytes(view["data"]), p.dequantize(i), view["format"])
            pulled[step + 1] = got
        try:
            output, _ = reader.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            reader.kill()
            self.fail_with_logs("the reader did not finish")
        if reader.returncode != 0:
            self.fail_with_logs("the reader failed:\n" + output)
        read = sorted(int(f[1:-4]) for f in os.listdir(out_dir))
        self.assertIn(STEPS, read, output)
        formats = set()
        for v in read:
            with np.load(os.path.join(out_dir, "v%d.npz" % v)) as z:
                items = {k[2:]: z[k] for k in z.files if k.startswith("p:")}
                fp32 = {k[2:]: z[k] for k in z.files if k.startswith("f:")}
                bf16 = {k[2:]: z[k] for k in z.files if k.startswith("b:")}
            self.assertEqual(set(fp32), set(pulled[v]))
            for name, (data, values, fmt) in pulled[v].items():
                formats.add(fmt)
                self.assertEqual(items[name].tobytes(), data, "%s: version %d of %s" % (recipe, v, name))
                np.testing.assert_array_equal(fp32[name], values, "%s v%d %s" % (recipe, v, name))
                # as_="bf16": the dequantized values rounded to nearest even (bf16 ones as published).
                bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
                np.testing.assert_array_equal(bf16[name], rounded, "%s v%d %s as bf16" % (recipe, v, name))
                decoded = decode_published(fmt, items, name).reshape(values.shape)
                np.testing.assert_allclose(decoded, values, rtol=2e-7, atol=0,
                                           err_msg="%s: the published convention of %s" % (recipe, fmt))
        # mainstayctl export of the last version: the same tensors as the reader read, in files.
        export = os.path.join(self.cluster.dir, "export-" + recipe)
        r = self.cluster.ctl("export", "--job", c0.job_id, "--out", export, "--version", str(STEPS), "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["files"], ["model.safetensors"])
        metadata, files = load_safetensors(os.path.join(export, "model.safetensors"))
        self.assertEqual(metadata["mainstay_version"], str(STEPS))
        with np.load(os.path.join(out_dir, "v%d.npz" % STEPS)) as z:
            items = {k[2:]: z[k] for k in z.files if k.startswith("p:")}
        self.assertEqual(set(files), set(items))
        for name, (dtype, array) in files.items():
            self.assertEqual(array.tobytes(), np.ascontiguousarray(items[name]).tobytes(), name)
            self.assertEqual(tuple(array.shape), tuple(items[name].shape), name)
        return c0, token, formats

    def test_a_reader_reads_what_the_trainers_pulled_in_every_format(self):
        seen = set()
        for recipe in ("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_subchannel_scaling_mixed",
                       "bf16_with_mxfp8_mixed", "bf16_with_nvfp4_mixed"):
            with self.subTest(recipe=recipe):
                _, _, formats = self.check_recipe(recipe)
                seen |= formats
        self.assertEqual(seen, {"bf16", "fp8_e4m3_current", "fp8_block", "mxfp8", "nvfp4"})

    def test_the_reader_token_only_reads_its_own_job_and_a_rotation_cuts_it_off(self):
        a = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec("scope-a", "bf16_mixed")), rank=0,
                            timeout_s=60)
        b = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec("scope-b", "bf16_mixed")), rank=0,
                            timeout_s=60)
        for c in (a, b):
            for bucket in range(len(c.layout.buckets)):
                c.push_initial_params(bucket, np.zeros(c.layout.buckets[bucket]["numel"], np.float32),
                                      all_shards=True, wait=True)
        r = self.cluster.ctl("jobs", "reader-token", a.job_id)
        self.assertEqual(r.returncode, 0, r.stderr)
        token = r.stdout.strip()
        self.assertEqual(token, a.get_reader_token())
        reader = mainstay.WeightReader(self.cluster.address, a.job_id, token, timeout_s=10)
        self.assertEqual(reader.latest(), 0)
        self.assertEqual(len(list(reader.tensors(0, as_="fp32"))), 4)
        # An fp32 export split into files of at most 1 MiB (one tensor each), with an index.
        export = os.path.join(self.cluster.dir, "export-split")
        r = self.cluster.ctl("export", "--job", a.job_id, "--out", export, "--as", "fp32", "--max-file-bytes",
                             str(1 << 20))
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(export, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.assertEqual(len(set(index["weight_map"].values())), 4)
        read = dict(reader.tensors(0, as_="fp32"))
        for name, file in index["weight_map"].items():
            _, tensors = load_safetensors(os.path.join(export, file))
            np.testing.assert_array_equal(tensors[name][1], as_numpy(read[name]))
        self.assertEqual(os.listdir(export).count("model.safetensors"), 0)
        self.assertFalse([f for f in os.listdir(export) if f.endswith(".tmp")])
        r = self.cluster.ctl("export", "--job", a.job_id, "--out", export, "--as", "int4")
        self.assertEqual(r.returncode, 2, r.stderr)
        # Another job: refused at attach.
        with self.assertRaises(mainstay.Error) as other:
            mainstay.WeightReader(self.cluster.address, b.job_id, token, timeout_s=10)
        self.assertEqual(other.exception.code, "PERMISSION_DENIED")
        # No pushes, no FinishStep, no minting, from the client library...
        raw = mainstay.Client(self.cluster.address, job_id=a.job_id, reader_token=token, timeout_s=10)
        self.assertTrue(raw.reader)
        self.assertEqual(raw.job_token, "")
        g = np.zeros(a.layout.buckets[0]["shard_numel"], np.float32)
        for call in (lambda: raw.push_grad(0, 0, g, wait=True), lambda: raw.finish_step(0, lr=1e-3, weight_decay=0.0),
                     lambda: raw.get_reader_token()):
            with self.assertRaises(mainstay.Error) as refused:
                call()
            self.assertEqual(refused.exception.code, "FAILED_PRECONDITION")
        # ... and from the daemons, for a client that sends it as a job token anyway.
        forged = mainstay.Client(self.cluster.address, job_id=a.job_id, job_token=token, rank=0, timeout_s=10)
        with self.assertRaises(mainstay.Error) as denied:
            forged.push_grad(0, 0, g, wait=True)
        self.assertEqual(denied.exception.code, "PERMISSION_DENIED")
        self.assertIn("reader token", denied.exception.message)
        with self.assertRaises(mainstay.Error) as denied:
            forged.get_step_stats(0)
        self.assertEqual(denied.exception.code, "PERMISSION_DENIED")
        # A rotation: the old token pulls nothing more; the new one does.
        r = self.cluster.ctl("jobs", "reader-token", a.job_id, "--rotate")
        self.assertNotEqual(r.returncode, 0, "a rotation without --yes")
        r = self.cluster.ctl("jobs", "reader-token", a.job_id, "--rotate", "--yes")
        self.assertEqual(r.returncode, 0, r.stderr)
        rotated = r.stdout.strip()
        self.assertNotEqual(rotated, token)
        process_cluster.wait_for(lambda: self._refused(reader), "the old reader token to be refused",
                                 logs=self.cluster.logs)
        self.assertEqual(mainstay.WeightReader(self.cluster.address, a.job_id, rotated, timeout_s=10).latest(), 0)

    @staticmethod
    def _refused(reader):
        try:
            reader.latest()
            return False
        except mainstay.Error as e:
            return e.code == "PERMISSION_DENIED"


def patch_bytes(old, new):
    """Bytes of the byte patch (common/byte_patch.h) turning `old` into `new`: per changed byte,
    the LEB128 varint of the unchanged bytes before it, then the byte."""
    a = np.frombuffer(old, np.uint8)
    b = np.frombuffer(new, np.uint8)
    changed = np.flatnonzero(a != b)
    gaps = np.diff(np.concatenate(([-1], changed))) - 1
    varints = 1 + sum((gaps >= (1 << (7 * k))).astype(np.int64) for k in range(1, 5))
    return int(varints.sum()) + len(changed)


class DeltaSyncTest(unittest.TestCase):
    """WeightReader.tensors(since=...): only the 64 KiB chunks of published data that changed
    come, each as a byte patch when the daemons still keep the reader's version and that is
    smaller, and the patched copy is byte-identical to a full read (docs/weight_serving.md)."""

    CHUNK = 64 << 10

    def expected_delta(self, previous, now, shards, patches):
        """What a delta from `previous` to `now` (one bucket's packed data) sends: each changed
        chunk of each shard, whole or (with `patches`) as a byte patch when that is smaller."""
        sent = 0
        shard_bytes = len(now) // shards
        for s in range(shards):
            for begin in range(s * shard_bytes, (s + 1) * shard_bytes, self.CHUNK):
                end = min(begin + self.CHUNK, (s + 1) * shard_bytes)
                if now[begin:end] != previous[begin:end]:
                    whole = end - begin
                    sent += min(whole, patch_bytes(previous[begin:end], now[begin:end])) if patches else whole
        return sent

    def setUp(self):
        self.cluster = process_cluster.Cluster(daemons=2, lease_ms=3000)

    def tearDown(self):
        self.cluster.stop()

    def start_job(self):
        """Two trainers of a job with fp8_block (blockwise scales) and a bf16 norm, at version 0."""
        c0 = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec("delta", "bf16_with_fp8_subchannel_scaling_mixed")),
                             rank=0, timeout_s=120)
        c1 = mainstay.Client(self.cluster.address, job_id=c0.job_id, job_token=c0.job_token, rank=1, timeout_s=120)
        rng = np.random.default_rng(3)
        for b in range(len(c0.layout.buckets)):
            c0.push_initial_params(b, rng.standard_normal(c0.layout.buckets[b]["numel"]).astype(np.float32) * 0.1,
                                   all_shards=True, wait=True)
        return c0, c1

    @staticmethod
    def train_step(c0, c1, step):
        """One step whose gradients reach only the first rows of each shard, so most chunks keep
        their bytes (Adam moves only what got a gradient)."""
        layout = c0.layout
        for r, c in enumerate((c0, c1)):
            for b in range(len(layout.buckets)):
                n = layout.buckets[b]["shard_numel"]
                g = np.zeros(n, np.float32)
                g[:n // 16] = np.random.default_rng(step * 7 + r).standard_normal(n // 16).astype(np.float32)
                c.push_grad(b, step, g, wait=True)
        done = []
        t = threading.Thread(target=lambda: done.append(c1.finish_step(step, lr=1e-4, weight_decay=0.0)))
        t.start()
        c0.finish_step(step, lr=1e-4, weight_decay=0.0)
        t.join()

    def test_deltas_send_exactly_the_changed_chunks_and_patch_to_a_full_reads_bytes(self):
        c0, c1 = self.start_job()
        layout = c0.layout
        buckets = range(len(layout.buckets))
        token = c0.get_reader_token()
        reader = mainstay.WeightReader(self.cluster.address, c0.job_id, token, timeout_s=60)
        full_reader = mainstay.WeightReader(self.cluster.address, c0.job_id, token, timeout_s=60)
        list(reader.tensors(0))
        self.assertEqual(reader.delta_fraction(), 1.0)
        previous = {b: bytes(c0.pull_bucket(b, 0).data) for b in buckets}
        kept = {b: c0.pull_bucket(b, 0) for b in buckets}  # version 0, long evicted at the end
        fractions = []
        whole_chunks = []  # what chunk-level deltas would have sent
        scales_sent = scales_total = 0  # the fp8 blocks' scales: a delta too (the patched copy's are compared)
        for step in range(20):
            self.train_step(c0, c1, step)
            version = step + 1
            delta = {name: as_numpy(x).tobytes() for name, x in reader.tensors(version, since=version - 1)}
            full = {name: as_numpy(x).tobytes() for name, x in full_reader.tensors(version)}
            self.assertEqual(delta, full, "step %d: the patched copy is not a full read's bytes" % step)
            # What had to come: the chunks, shard by shard, whose bytes differ from the last
            # version's, as byte patches (the daemons keep the last version: retained_versions).
            expected = whole = 0
            for b in buckets:
                now = bytes(c0.pull_bucket(b, version).data)
                expected += self.expected_delta(previous[b], now, 2, patches=True)
                whole += self.expected_delta(previous[b], now, 2, patches=False)
                previous[b] = now
            self.assertEqual(reader.data_bytes_received, expected, "step %d" % step)
            fractions.append(reader.delta_fraction())
            whole_chunks.append(whole)
            scales_sent += reader.scale_bytes_received
            scales_total += reader.scale_bytes
        self.assertLess(max(fractions), 1.0, fractions)
        self.assertGreater(scales_total, 0)
        self.assertLess(scales_sent, scales_total / 2)
        total = sum(len(previous[b]) for b in buckets)
        print("delta sync, 20 steps: %.4f of the data sent per version on average (min %.4f, max %.4f); "
              "whole changed chunks would have been %.3f"
              % (sum(fractions) / len(fractions), min(fractions), max(fractions),
                 sum(whole_chunks) / len(whole_chunks) / total))
        with self.assertRaises(ValueError):
            list(reader.tensors(20, since=3))
        # A copy of a version the daemons no longer keep (0, with 20 newer): whole changed
        # chunks, and still the exact bytes.
        for b in buckets:
            pulled = c0.pull_bucket(b, 20, since=kept[b])
            self.assertEqual(bytes(pulled.data), previous[b])
            old = bytes(kept[b].data)
            self.assertEqual(pulled.data_bytes_received, self.expected_delta(old, previous[b], 2, patches=False))
            self.assertGreater(pulled.data_bytes_received,
                               self.expected_delta(old, previous[b], 2, patches=True))


    def test_a_reader_keeping_its_base_gets_patches_after_more_steps_than_are_retained(self):
        c0, c1 = self.start_job()
        buckets = range(len(c0.layout.buckets))
        token = c0.get_reader_token()
        keeping = mainstay.WeightReader(self.cluster.address, c0.job_id, token, timeout_s=60, keep_base_s=120)
        plain = mainstay.WeightReader(self.cluster.address, c0.job_id, token, timeout_s=60)
        list(keeping.tensors(0))
        before = {b: bytes(c0.pull_bucket(b, 0).data) for b in buckets}
        self.train_step(c0, c1, 0)
        list(plain.tensors(1))  # (pins are the job's: a base nobody else keeps)
        plain_before = {b: bytes(c0.pull_bucket(b, 1).data) for b in buckets}
        for step in range(1, 6):  # past the daemons' 4 retained versions: versions 0 and 1 go unless pinned
            self.train_step(c0, c1, step)
        after = {b: bytes(c0.pull_bucket(b, 6).data) for b in buckets}
        patched = sum(self.expected_delta(before[b], after[b], 2, patches=True) for b in buckets)
        self.assertLess(patched, sum(self.expected_delta(before[b], after[b], 2, patches=False) for b in buckets))
        list(keeping.tensors(6, since=0))
        self.assertEqual(keeping.data_bytes_received, patched)
        list(plain.tensors(6, since=1))
        self.assertEqual(plain.data_bytes_received,
                         sum(self.expected_delta(plain_before[b], after[b], 2, patches=False) for b in buckets))
        # The kept base follows the reader: version 6 is now pinned, version 0 released.
        for step in range(6, 12):
            self.train_step(c0, c1, step)
        later = {b: bytes(c0.pull_bucket(b, 12).data) for b in buckets}
        list(keeping.tensors(12, since=6))
        self.assertEqual(keeping.data_bytes_received,
                         sum(self.expected_delta(after[b], later[b], 2, patches=True) for b in buckets))
        keeping.close()
        with self.assertRaises(ValueError):
            mainstay.WeightReader(self.cluster.address, c0.job_id, token, keep_base_s=601)


class ReaderCapTest(unittest.TestCase):
    """mainstayd --reader-bytes-per-sec: readers are slowed to the cap, trainers are not."""

    def setUp(self):
        self.cluster = process_cluster.Cluster(daemons=2, lease_ms=3000,
                                               daemon_flags=["--reader-bytes-per-sec", "1000000"])

    def tearDown(self):
        self.cluster.stop()

    def test_readers_are_capped_and_trainers_are_not(self):
        c = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec("capped", "bf16_mixed")), rank=0,
                            timeout_s=60)
        for b in range(len(c.layout.buckets)):
            c.push_initial_params(b, np.ones(c.layout.buckets[b]["numel"], np.float32), all_shards=True, wait=True)
        reader = mainstay.WeightReader(self.cluster.address, c.job_id, c.get_reader_token(), timeout_s=60)
        reads = 5
        t0 = time.monotonic()
        for _ in range(reads):
            total = sum(as_numpy(t).nbytes for _, t in reader.tensors(0, as_="published"))
        reader_s = time.monotonic() - t0
        # 5 reads of ~1.5 MB, half from each daemon at 1 MB/s after a 1 MB burst: >= 2.75 s.
        per_daemon = reads * total / 2
        self.assertGreater(reader_s, (per_daemon - 1e6) / 1e6 * 0.6, "the readers were not slowed to the cap")

        t0 = time.monotonic()
        for _ in range(reads):
            for b in range(len(c.layout.buckets)):
                c.pull_bucket(b, 0)
        trainer_s = time.monotonic() - t0
        print("capped at 1 MB/s per daemon: %d reads of %.2f MB by a reader %.2f s, by a trainer %.2f s"
              % (reads, total / 1e6, reader_s, trainer_s))
        self.assertLess(trainer_s, reader_s / 2, "the trainer's pulls went through the readers' cap")


class ReaderCapDeltaTest(unittest.TestCase):
    """A reader's delta pull is charged against the cap for what it sends, not for whole shards."""

    CAP = 10000  # bytes/s per daemon: one 64 KB shard puts the cap 5.4 s into debt

    def setUp(self):
        self.cluster = process_cluster.Cluster(daemons=2, lease_ms=3000,
                                               daemon_flags=["--reader-bytes-per-sec", str(self.CAP)])

    def tearDown(self):
        self.cluster.stop()

    def test_a_delta_that_sends_nothing_is_not_held_back_by_the_caps_debt(self):
        job = dict(spec("capped-delta", "bf16_mixed"), bucket_numel=1 << 16,
                   tensors=[{"name": "w", "shape": [256, 256]}])  # one bucket: a 64 KB bf16 shard per daemon
        c = mainstay.Client(self.cluster.address, spec_json=json.dumps(job), rank=0, timeout_s=60)
        c.push_initial_params(0, np.ones(1 << 16, np.float32), all_shards=True, wait=True)
        reader = mainstay.WeightReader(self.cluster.address, c.job_id, c.get_reader_token(), timeout_s=60)
        list(reader.tensors(0))  # admitted on the burst, then (64 KB - 20 KB) / 20 KB/s of debt
        t0 = time.monotonic()
        list(reader.tensors(0, since=0))  # nothing changed: no chunk to send
        delta_s = time.monotonic() - t0
        self.assertEqual(reader.data_bytes_received, 0)
        # Charged a whole shard again, it would wait out the debt (5.4 s) first; the margin leaves
        # room for a loaded 2-core CI machine.
        self.assertLess(delta_s, 2.5, "a delta that sends nothing waited for the readers' cap")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--reader":
        run_reader(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
    else:
        unittest.main()
