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
                 tls_ca_file="", tls_cert_file="", tls_key_file="", tls_server_name="", keep_base_s=0.0):
        """keep_base_s: when > 0 (at most 600), the version the last tensors() call read stays
        pinned on the daemons that long (renewed by every read), so a later
        tensors(since=<that version>) still gets byte patches after training ran more than the
        daemons' --retained-versions steps ahead. Each reader doing so costs the daemons one
        published copy of its version. 0: nothing kept (such a delta then sends whole chunks)."""
        if not 0.0 <= keep_base_s <= 600.0:
            raise ValueError("keep_base_s must be in [0, 600] seconds, got %r" % (keep_base_s,))
        self._keep_base_s = keep_base_s
        self._base_pin = None  # the pin of self.version when keep_base_s > 0
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
        # Delta sync: what the last tensors() call pulled, per bucket (a copy of its published
        # bytes, the base of the next tensors(since=...)), and how much of its data came.
        self._held = {}
        self.data_bytes_received = 0  # by the last tensors() call: packed data that came
        self.data_bytes = 0           # ... and the packed data it read, sent or not
        self.scale_bytes_received = 0  # the same for the block scales
        self.scale_bytes = 0

    @property
    def job_id(self):
        return self._client.job_id

    def close(self):
        """Releases the pins and the connections (also done when the reader is garbage collected,
        but for the pins, which then expire)."""
        if self._client is not None:
            for version in list(self._pins):
                self.unpin(version)
            if self._base_pin is not None:
                self._client.release_pin(self._base_pin)
                self._base_pin = None
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

    def tensors(self, version=None, names=None, as_="published", since=None):
        """Yields (name, tensor) for every tensor of the job (or those in `names`), whole and in
        model space, at `version` (None: the newest; `reader.version` says which it was).

        since: the version the previous tensors() call read (`reader.version` then): delta sync.
        Each daemon sends only the 64 KiB chunks of packed data and block scales that changed
        since then, as the bytes that changed when it still keeps that version (the newest
        --retained-versions, or a pinned one); the reader patches a copy of what it holds and checks
        the result against the daemons' CRC-32C before yielding anything. `delta_fraction()`
        then says how much of the data came. The reader keeps the buckets of its last read for
        this (the published size of what it read, in memory).

        as_="fp32": the dequantized values, float32, shaped like the tensor.
        as_="bf16": the same rounded to bfloat16 (nearest even); bf16 tensors as published.
        as_="published": the published data, then its scales, by the conventions of
        docs/weight_serving.md and mainstay/published.h (e.g. "x.weight" and
        "x.weight_scale_inv" for fp8_block). FP8 codes and packed NVFP4 are uint8.

        Every bucket is pulled at the same version, all at once, with the version pinned on the
        daemons meanwhile (see pin()). A version the daemons no longer keep is mainstay.Error
        FAILED_PRECONDITION naming the newest; one that was never published (its step was
        skipped) is ValueError.
        """
        if as_ not in ("published", "bf16", "fp32"):
            raise ValueError("as_ must be 'published', 'bf16' or 'fp32', got %r" % (as_,))
        if since is not None and (since != self.version or not self._held):
            raise ValueError("tensors(since=%r): a delta starts from the version the previous tensors() call read "
                             "(%r)" % (since, self.version))
        torch = _torch()
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
            own_pin = self._client.pin_newest_version(120.0)
            version = own_pin.version
        elif version not in self._pins:
            try:
                own_pin = self._client.pin_version(version, 120.0)
            except _mainstay.Error as e:
                # Not published yet on the daemon that refused (its newest is older; another
                # daemon may have published it already): the pulls wait for it, and it is new.
                # Evicted there (its newest is newer): gone.
                newest = (e.info or {}).get("version")
                if e.code != "FAILED_PRECONDITION" or (newest if newest is not None else self.latest()) >= version:
                    raise
                own_pin = None
        self.version = version
        try:
            handles = {b: self._client.pull_bucket(b, version, wait=False,
                                                   since=self._held.get(b) if since is not None else None)
                       for b in buckets}
            pulled = {}
            for b in buckets:
                p = handles[b].wait()
                if p.unchanged or p.version != version:
                    raise ValueError("job %s: version %d was never published (its step was skipped); bucket %d's "
                                     "newest before it is %d" % (self.job_id, version, b, p.version))
                pulled[b] = p
            if self._keep_base_s > 0:
                # The new base, pinned before the old one goes (its own pin still holds it).
                base_pin, self._base_pin = self._base_pin, self._client.pin_version(version, self._keep_base_s)
                if base_pin is not None:
                    self._client.release_pin(base_pin)
        finally:
            if own_pin is not None:
                self._client.release_pin(own_pin)
        self._held = pulled
        self.data_bytes_received = sum(p.data_bytes_received for p in pulled.values())
        self.data_bytes = sum(p.data.nbytes for p in pulled.values())
        self.scale_bytes_received = sum(p.scale_bytes_received for p in pulled.values())
        self.scale_bytes = sum(p.scale_bytes for p in pulled.values())
        for n in wanted:
            index = self._tensors[n][0]
            p = pulled[self._tensors[n][1]["bucket"]]
            if as_ == "published":
                items = p.published(index)
            else:
                items = [p.dequantized(index, bf16=(as_ == "bf16"))]
            for name, dtype, array in items:
                self.bytes_read += array.nbytes
                yield name, self._out(array, dtype, torch)

    def delta_fraction(self):
        """Of the packed data and block scales the last tensors() call read, the fraction that
        came over the wire (1.0 for a full read; a delta's changed chunks or byte patches
        otherwise). data_bytes_received / data_bytes and scale_bytes_received / scale_bytes say
        it for each."""
        total = self.data_bytes + self.scale_bytes
        return (self.data_bytes_received + self.scale_bytes_received) / total if total else 0.0

    @staticmethod
    def _out(array, dtype, torch):
        if torch is None:
            return array
        if dtype == "BF16":
            return torch.from_numpy(array.view("int16")).view(torch.bfloat16)
        return torch.from_numpy(array)
