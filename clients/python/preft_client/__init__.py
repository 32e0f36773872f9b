"""preft_client: the Python SDK of a preft cluster's public gRPC API (preft.v1.Preft).

    from preft_client import Client, Positions
    with Client("router:50051", token="...") as c:
        out = c.generate("Hello", model="user-42", positions=Positions.PROMPT, max_tokens=32)
        print(out.text)
        for delta in c.stream("Hello", max_tokens=32):
            print(delta.text, end="", flush=True)

The stubs under _proto/ are generated from proto/preft/v1/preft.proto at build time
(clients/python/CMakeLists.txt, Debian's python3-grpc-tools); this module is the typed layer.
"""
import dataclasses
import enum
import os
import sys
from typing import Iterator, List, Optional, Sequence, Union

import grpc

_PROTO = os.path.join(os.path.dirname(__file__), "_proto")
if _PROTO not in sys.path:
    sys.path.insert(0, _PROTO)
from preft.v1 import preft_pb2 as pb  # noqa: E402
from preft.v1 import preft_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["Client", "Positions", "Generation", "Delta", "Adapter", "PreftError", "pb"]


class Positions(enum.IntEnum):
    """Where an adapter applies: its own default, prompt tokens only (PreFT), or every token."""
    DEFAULT = pb.ADAPTER_POSITIONS_UNSPECIFIED
    PROMPT = pb.ADAPTER_POSITIONS_PROMPT
    ALL = pb.ADAPTER_POSITIONS_ALL


class PreftError(Exception):
    """A call the server refused or that failed: `code` is the grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass
class Delta:
    """One streamed message: new tokens and text; `finish_reason` on the last."""
    token_ids: List[int]
    text: str
    finish_reason: Optional[str] = None


@dataclasses.dataclass
class Generation:
    request_id: str
    token_ids: List[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, served from a worker's prefix cache
    adapter: str = ""
    adapter_version: int = 0
    logprobs: List[pb.TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Adapter:
    name: str
    version: int
    type: str
    rank: int
    default_positions: Positions
    path: str


_FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
           pb.FINISH_REASON_ABORT: "abort"}


def _adapter(a: "pb.AdapterInfo") -> Adapter:
    return Adapter(name=a.name, version=a.version,
                   type="lora" if a.type == pb.ADAPTER_TYPE_LORA else "direft", rank=a.rank,
                   default_positions=Positions(a.default_positions), path=a.path)


class Client:
    """A connection to a router. Thread-safe; use as a context manager or call close()."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: Optional[str] = None,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, timeout: float = 120.0):
        if tls_ca or tls_cert:
            read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
            creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
            self._channel = grpc.secure_channel(address, creds)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.PreftStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._timeout = timeout

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise PreftError(e.code(), e.details()) from None

    @staticmethod
    def _request(prompt: Union[str, Sequence[int]], model: str, positions: Positions,
                 max_tokens: int, temperature: float, top_p: float, top_k: int,
                 seed: Optional[int], stop: Sequence[str], ignore_eos: bool,
                 logprobs: Optional[int], request_id: str,
                 logprobs_mode: str = "raw") -> "pb.GenerateRequest":
        req = pb.GenerateRequest(request_id=request_id, model=model,
                                 adapter_positions=int(positions), stream=True)
        if isinstance(prompt, str):
            req.text = prompt.encode()
        else:
            req.token_ids.ids.extend(prompt)
        s = req.sampling
        s.max_tokens = max_tokens
        s.temperature = temperature
        s.top_p = top_p
        s.top_k = top_k
        if seed is not None:
            s.seed = seed
        if logprobs is not None:
            s.logprobs = logprobs
        # "raw": the model's softmax; "processed": the distribution sampled from (RL).
        modes = {"raw": pb.LOGPROBS_MODE_RAW, "processed": pb.LOGPROBS_MODE_PROCESSED}
        if logprobs_mode not in modes:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', not {logprobs_mode!r}")
        s.logprobs_mode = modes[logprobs_mode]
        s.stop.extend(stop)
        s.ignore_eos = ignore_eos
        return req

    def stream(self, prompt: Union[str, Sequence[int]], *, model: str = "",
               positions: Positions = Positions.DEFAULT, max_tokens: int = 16,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: Optional[int] = None, stop: Sequence[str] = (), ignore_eos: bool = False,
               logprobs: Optional[int] = None, request_id: str = "",
               logprobs_mode: str = "raw") -> Iterator[Delta]:
        """Yields the generation as it streams. Closing the iterator early cancels it."""
        req = self._request(prompt, model, positions, max_tokens, temperature, top_p, top_k,
                            seed, stop, ignore_eos, logprobs, request_id, logprobs_mode)
        call = self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield Delta(list(msg.token_ids), msg.text,
                            _FINISH.get(msg.finish.reason) if msg.HasField("finish") else None)
        except grpc.RpcError as e:
            raise PreftError(e.code(), e.details()) from None
        finally:
            call.cancel()

    def generate(self, prompt: Union[str, Sequence[int]], **kwargs) -> Generation:
        """Runs a generation to its end (the same keywords as stream())."""
        args = dict(model="", positions=Positions.DEFAULT, max_tokens=16, temperature=0.0,
                    top_p=1.0, top_k=0, seed=None, stop=(), ignore_eos=False, logprobs=None,
                    request_id="", logprobs_mode="raw")
        unknown = set(kwargs) - set(args)
        if unknown:
            raise TypeError(f"unknown arguments: {sorted(unknown)}")
        args.update(kwargs)
        req = self._request(prompt, **args)
        out = Generation(request_id="", token_ids=[], text="", finish_reason="",
                         prompt_tokens=0, completion_tokens=0)
        try:
            for msg in self._stub.Generate(req, timeout=self._timeout, metadata=self._metadata):
                out.request_id = msg.request_id
                out.token_ids.extend(msg.token_ids)
                out.text += msg.text
                out.logprobs.extend(msg.logprobs)
                if msg.HasField("finish"):
                    f = msg.finish
                    out.finish_reason = _FINISH.get(f.reason, "")
                    out.prompt_tokens = f.usage.prompt_tokens
                    out.completion_tokens = f.usage.completion_tokens
                    out.cached_tokens = f.usage.cached_tokens
                    out.adapter, out.adapter_version = f.adapter, f.adapter_version
        except grpc.RpcError as e:
            raise PreftError(e.code(), e.details()) from None
        return out

    def abort(self, request_id: str) -> None:
        self._call(self._stub.Abort, pb.AbortRequest(request_id=request_id))

    def models(self) -> "pb.ListModelsResponse":
        return self._call(self._stub.ListModels, pb.ListModelsRequest())

    def adapters(self) -> List[Adapter]:
        return [_adapter(a) for a in self.models().adapters]

    def register_adapter(self, name: str, path: str, load: bool = False) -> Adapter:
        r = self._call(self._stub.RegisterAdapter,
                       pb.RegisterAdapterRequest(name=name, path=path, load=load))
        return _adapter(r.adapter)

    def unload_adapter(self, name: str, unregister: bool = False) -> None:
        self._call(self._stub.UnloadAdapter,
                   pb.UnloadAdapterRequest(name=name, unregister=unregister))

    def update_adapter(self, name: str, folder: str) -> int:
        """Streams the folder's adapter files as the adapter's next version; returns it."""
        files = []
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                files.append((f, fh.read()))

        def messages():
            yield pb.UpdateAdapterRequest(header=pb.UpdateAdapterHeader(name=name))
            for f, data in files:
                for at in range(0, len(data), 1 << 20):
                    yield pb.UpdateAdapterRequest(
                        chunk=pb.AdapterFileChunk(file_name=f, data=data[at:at + (1 << 20)]))

        try:
            r = self._stub.UpdateAdapter(messages(), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise PreftError(e.code(), e.details()) from None
        return r.version
