"""Read a training job's published weights: ``mainstay.WeightReader``.

A reader attaches with the job's read-only reader token (``Client.get_reader_token()`` of a
trainer or launcher holding the job token, or ``mainstayctl jobs reader-token JOB``), polls for
new versions and reads whole tensors in model space, as an inference engine's ``load_weights``
consumes them. It pulls from every daemon of the job in parallel, over the same transports as
the trainers, and can do nothing but pull: the daemons refuse its token for pushes, FinishStep,
step statistics and state. docs/weight_serving.md has the conventions and the costs.

Tensors are ``torch`` tensors (CPU) when PyTorch is importable, else numpy arrays (bf16 then as
uint16 bit patterns).
"""

import time

from . import _mainstay

# What `as_="published"` yields besides the tensor's data, per format: (suffix, meaning).
# The data is the published bytes: bf16/fp16 values, FP8 E4M3/E5M2 codes (uint8, the tensor's
# shape), MXFP8 E4M3 codes, or NVFP4 E2M1 codes packed two per byte (uint8 [rows, cols / 2], the
# even element in the low nibble).
PUBLISHED_SCALES = {
    "bf16": (),
    "fp16": (),
    # w = code * weight_scale_inv (one FP32 for the tensor), DeepSeek-V3's name.
    "fp8_e4m3_delayed": (("_scale_inv", "FP32 scalar: value = code * scale_inv"),),
    "fp8_e5m2_delayed": (("_scale_inv", "FP32 scalar: value = code * scale_inv"),),
    "fp8_e4m3_current": (("_scale_inv", "FP32 scalar: value = code * scale_inv"),),
    "fp8_e5m2_current": (("_scale_inv", "FP32 scalar: value = code * scale_inv"),),
    # w = code * weight_scale_inv[r // 128, c // 128]: DeepSeek-V3's checkpoints, as vLLM and
    # SGLang load them.
    "fp8_block": (("_scale_inv", "FP32 [ceil(rows/128), ceil(cols/128)]: value = code * scale_inv[tile]"),),
    # w = code * 2^(e - 127), e = weight_scale[r, c // 32] (E8M0 bytes, uint8).
    "mxfp8": (("_scale", "E8M0 uint8 [rows, cols/32]: value = code * 2^(scale - 127)"),),
    # w = e2m1(code) * e4m3(weight_scale[r, c // 16]) * weight_scale_2: ModelOpt's NVFP4 names.
    # Mainstay's tiles are 16x16; weight_scale repeats each tile's scale on its 16 rows.
    "nvfp4": (("_scale", "E4M3 uint8 [rows, cols/16]: the 16x16 tile scales, each repeated on its 16 rows"),
              ("_scale_2", "FP32 scalar: the global decode scale")),
}


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


class WeightReader:
    """Published versions of one job, for a reader (see the module docstring).

    Not thread-safe: one reader per thread (each holds its own connections).
    """

    def __init__(self, coordinator, job_id, reader_token, *, transport="", timeout_s=60.0,
                 tls_ca_file="", tls_cert_file="", tls_key_file="", tls_server_name=""):
        self._client = _mainstay.Client(coordinator, job_id=job_id, reader_token=reader_token, timeout_s=timeout_s,
                                        transport=transport, tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                                        tls_key_file=tls_key_file, tls_server_name=tls_server_name)
        self.layout = self._client.layout
        # (Layout.tensors builds a new list of dicts at every access: read it once.)
        self._tensor_list = self.layout.tensors
        self._tensors = {t["name"]: (i, t) for i, t in enumerate(self._tensor_list)}
        self.bytes_read = 0  # published bytes pulled so far (data and scales)
        self._pins = {}      # version -> VersionPin
        self.version = None  # the version the last tensors() call read

    @property
    def job_id(self):
        return self._client.job_id

    def close(self):
        """Releases the pins and the connections (also done when the reader is garbage collected,
        but for the pins, which then expire)."""
        if self._client is not None:
            for version in list(self._pins):
                self.unpin(version)
        self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def latest(self):
        """The newest published version (pulls one shard of bucket 0 to learn it)."""
        pulled = self._client.pull_shard(0, 0, _mainstay.Client.LATEST)
        return pulled.version

    def wait_newer(self, version, timeout_s):
        """The newest published version after `version`, waiting up to `timeout_s` seconds for
        one; None when none came in time. (Versions of skipped steps, with non-finite gradients,
        are never published: the wait goes on to the next step's.)"""
        deadline = time.monotonic() + timeout_s
        wanted = version + 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                pulled = self._client.pull_shard(0, 0, wanted, timeout_s=left)
            except _mainstay.Error as e:
                if e.code == "DEADLINE_EXCEEDED":
                    return None
                if e.code != "FAILED_PRECONDITION":  # (that one: `wanted` is no longer kept)
                    raise
                pulled = None
            if pulled is None or pulled.version > version:
                newest = self.latest()
                if newest > version:
                    return newest
            wanted += 1  # step wanted - 1 was skipped: its version does not exist

    def _pin_latest(self):
        """(newest version, its pin): a newer version can evict the newest between the two calls,
        and then the next newest is pinned."""
        for _ in range(100):
            version = self.latest()
            try:
                return version, self._client.pin_version(version, 120.0)
            except _mainstay.Error as e:
                if e.code != "FAILED_PRECONDITION":
                    raise
        raise RuntimeError("job %s: no version stayed long enough to be pinned" % self.job_id)

    def pin(self, version, ttl_s=60.0):
        """Keeps `version` on every daemon for ttl_s seconds (at most 600; pin again to renew),
        while training goes on. tensors() pins what it reads by itself; pin to read a version
        in several calls. mainstay.Error FAILED_PRECONDITION when it is gone already."""
        self.unpin(version)
        self._pins[version] = self._client.pin_version(version, ttl_s)

    def unpin(self, version):
        """Releases a pin of pin(); a version not pinned is left as it is."""
        pin = self._pins.pop(version, None)
        if pin is not None:
            self._client.release_pin(pin)

    def tensors(self, version=None, names=None, as_="published"):
        """Yields (name, tensor) for every tensor of the job (or those in `names`), whole and in
        model space, at `version` (None: the newest; `reader.version` says which it was).

        as_="fp32": the dequantized values, float32, shaped like the tensor.
        as_="bf16": the same rounded to bfloat16 (PyTorch needed); bf16 tensors as published.
        as_="published": the published data, then its scales under the names of PUBLISHED_SCALES
        (e.g. "x.weight" and "x.weight_scale_inv" for fp8_block).

        Every bucket is pulled at the same version, all at once, with the version pinned on the
        daemons meanwhile (see pin()). A version the daemons no longer keep is mainstay.Error
        FAILED_PRECONDITION naming the newest; one that was never published (its step was
        skipped) is ValueError.
        """
        if as_ not in ("published", "bf16", "fp32"):
            raise ValueError("as_ must be 'published', 'bf16' or 'fp32', got %r" % (as_,))
        torch = _torch()
        if as_ == "bf16" and torch is None:
            raise ImportError("as_='bf16' needs PyTorch (numpy has no bfloat16); use as_='fp32' or 'published'")
        if names is None:
            wanted = [t["name"] for t in self._tensor_list]
        else:
            wanted = list(names)
            unknown = [n for n in wanted if n not in self._tensors]
            if unknown:
                raise KeyError("job %s has no tensor %s" % (self.job_id, ", ".join(repr(n) for n in unknown)))
        buckets = []
        for n in wanted:
            b = self._tensors[n][1]["bucket"]
            if b not in buckets:
                buckets.append(b)
        # Pinned while its buckets are pulled (unless the caller pinned it): training may publish
        # several versions meanwhile, and the daemons keep only a few.
        own_pin = None
        if version is None:
            version, own_pin = self._pin_latest()
        elif version not in self._pins:
            try:
                own_pin = self._client.pin_version(version, 120.0)
            except _mainstay.Error as e:
                if e.code != "FAILED_PRECONDITION" or version <= self.latest():
                    raise
                own_pin = None  # not published yet: the pulls wait for it (and it is new)
        self.version = version
        try:
            handles = {b: self._client.pull_bucket(b, version, wait=False) for b in buckets}
            pulled = {}
            for b in buckets:
                p = handles[b].wait()
                if p.unchanged or p.version != version:
                    raise ValueError("job %s: version %d was never published (its step was skipped); bucket %d's "
                                     "newest before it is %d" % (self.job_id, version, b, p.version))
                pulled[b] = p
        finally:
            if own_pin is not None:
                self._client.release_pin(own_pin)
        for n in wanted:
            index, info = self._tensors[n]
            p = pulled[info["bucket"]]
            if as_ == "fp32":
                yield n, self._out(p.dequantize(index), torch)
            elif as_ == "bf16":
                view = p.tensor(index)
                if view["format"] == "bf16":
                    bits = self._data(view, info).view("int16").reshape(tuple(info["shape"])).copy()
                    yield n, torch.from_numpy(bits).view(torch.bfloat16)
                else:
                    yield n, torch.from_numpy(p.dequantize(index)).to(torch.bfloat16)
            else:
                yield from self._published(n, p.tensor(index), info, torch)

    def _data(self, view, info):
        data = view["data"]
        self.bytes_read += data.nbytes
        return data

    def _published(self, name, view, info, torch):
        import numpy as np
        fmt = view["format"]
        shape = tuple(info["shape"])
        data = self._data(view, info)
        if fmt in ("bf16", "fp16"):
            values = data.view(np.uint16).reshape(shape).copy()
            if torch is not None:
                values = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16 if fmt == "bf16" else torch.float16)
            yield name, values
            return
        if fmt == "nvfp4":
            codes = data.reshape(shape[:-1] + (shape[-1] // 2,)).copy()
        else:
            codes = data.reshape(shape).copy()
        yield name, self._out(codes, torch)
        if fmt in ("fp8_block",):
            grid = np.asarray(view["scales"], dtype=np.float32).copy()
            self.bytes_read += grid.nbytes
            yield name + "_scale_inv", self._out(grid, torch)
        elif fmt == "mxfp8":
            grid = np.asarray(view["scales"], dtype=np.uint8).copy()
            self.bytes_read += grid.nbytes
            yield name + "_scale", self._out(grid, torch)
        elif fmt == "nvfp4":
            grid = np.asarray(view["scales"], dtype=np.uint8)
            self.bytes_read += grid.nbytes
            rows = shape[0]
            expanded = np.repeat(grid, 16, axis=0)[:rows].copy()
            yield name + "_scale", self._out(expanded, torch)
            yield name + "_scale_2", self._out(np.array(view["scale_inv"], dtype=np.float32), torch)
        else:  # per-tensor fp8
            yield name + "_scale_inv", self._out(np.array(view["scale_inv"], dtype=np.float32), torch)

    @staticmethod
    def _out(array, torch):
        return torch.from_numpy(array) if torch is not None else array
