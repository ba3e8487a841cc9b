"""libp2p protobuf streams read with a size cap on every frame, checked before a byte is buffered.

hivemind frames each message of a stream as a marker byte, an 8-byte length and that many bytes,
and its reader (``P2P.receive_raw_data``) buffers whatever length the sender wrote before any
handler runs: a caller, even one outside ``--allow`` or without a private swarm's key, could
make a node hold 255 MiB per stream before it was counted or refused. Here the caller's peer id
(which libp2p authenticates) is checked before the request is read at all, and a frame whose
length is over the cap ends the stream before its bytes are read; so does a request that does not
arrive within ``REQUEST_TIMEOUT``. The wire format is hivemind's, so its clients
(``P2P.iterate_protobuf_handler``) call these handlers unchanged; ``iterate_capped`` is the
client side with the same cap on the replies.

Threads: everything here runs on the transport's event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto.p2pd_pb2 import RPCError

__all__ = [
    "REQUEST_TIMEOUT",
    "FrameTooLarge",
    "Opening",
    "add_capped_stream_handler",
    "iterate_capped",
    "read_frame",
]

REQUEST_TIMEOUT = 10.0  # seconds a caller has to send its (small) request once the stream opens
_END_OF_STREAM_BYTES = 64  # what may follow a request: hivemind's empty end-of-stream frame


class FrameTooLarge(ValueError):
    """A frame whose declared length is over the cap (nothing of it was read)."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    """One frame: its marker and its bytes. ``FrameTooLarge`` when the length it declares is over
    ``max_bytes``, before any of those bytes is read; ``asyncio.IncompleteReadError`` when the
    stream ends first.

    Args:
        reader: the stream.
        max_bytes: the most bytes the frame may carry.
    """
    marker = await reader.readexactly(1)
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise FrameTooLarge(f"a frame of {length} bytes, more than {max_bytes}")
    return marker, await reader.readexactly(length)


Handler = Callable[[Message, P2PContext], AsyncIterator[Message]]


async def add_capped_stream_handler(
    p2p: P2P,
    name: str,
    handler: Handler,
    request_type: type[Message],
    *,
    max_request_bytes: int,
    allowed: Callable[[P2PContext], bool],
    refusal: Message,
    on_refused: Callable[[str], None],
) -> None:
    """Serve ``name``: one request in, a stream of messages out (hivemind's
    ``add_protobuf_handler(..., stream_output=True)``, with the checks above).

    Args:
        p2p: the running libp2p daemon.
        name: the protocol name.
        handler: the responses to a request (an async generator).
        request_type: the request's protobuf type.
        max_request_bytes: the largest request frame read.
        allowed: whether a caller is served (checked before a byte of its request is read).
        refusal: what a caller that is not allowed gets.
        on_refused: told "oversized_request" or "request_timeout" when a stream is ended unread.
    """

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
        with contextlib.closing(writer):
            if not allowed(context):
                with contextlib.suppress(Exception):
                    await P2P.send_protobuf(refusal, writer)
                return
            try:
                marker, data = await asyncio.wait_for(read_frame(reader, max_request_bytes), REQUEST_TIMEOUT)
                if marker != P2P.MESSAGE_MARKER:
                    return  # an error or end-of-stream frame where the request should be
                request = request_type.FromString(data)
            except FrameTooLarge:
                on_refused("oversized_request")
                return
            except TimeoutError:
                on_refused("request_timeout")
                return
            except (asyncio.IncompleteReadError, DecodeError, ConnectionError):
                return
            responding = asyncio.create_task(_respond(handler(request, context), writer))
            watching = asyncio.create_task(_until_closed(reader))
            try:  # the caller closing its side (a cancelled fetch) ends the responses
                await asyncio.wait({responding, watching}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (responding, watching):
                    task.cancel()
                await asyncio.gather(responding, watching, return_exceptions=True)

    await p2p.add_binary_stream_handler(name, handle)


async def _respond(responses: AsyncIterator[Message], writer: asyncio.StreamWriter) -> None:
    try:
        async for response in responses:
            await P2P.send_protobuf(response, writer)
    except (ConnectionError, asyncio.IncompleteReadError):
        return  # the caller went away
    except Exception as error:  # as hivemind does: the caller learns the handler failed
        with contextlib.suppress(Exception):
            await P2P.send_protobuf(RPCError(message=str(error)), writer)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Read hivemind's end-of-stream frame and wait for the stream's end; return at the end, or
    at anything more than small frames (a caller has nothing more to send)."""
    with contextlib.suppress(asyncio.IncompleteReadError, FrameTooLarge, ConnectionError):
        while True:
            await read_frame(reader, _END_OF_STREAM_BYTES)


async def iterate_capped(
    p2p: P2P,
    peer_id: PeerID,
    name: str,
    request: Message,
    response_type: type[Message],
    max_bytes: int,
    opened: Callable[[], None] | None = None,
) -> AsyncIterator[Message]:
    """The responses of a stream handler to ``request``, each frame read only when its declared
    length is at most ``max_bytes`` (``FrameTooLarge`` otherwise, nothing of it read); an error
    frame raises ``ConnectionError`` with its message.

    Args:
        p2p: the running libp2p daemon.
        peer_id: whom to call.
        name: the protocol name.
        request: the one request.
        response_type: the responses' protobuf type.
        max_bytes: the largest response frame read.
        opened: called once the stream is open and the request sent (what comes after is the
            holder's to answer).
    """
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)
    with contextlib.closing(writer):
        await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        if opened is not None:
            opened()
        while True:
            try:
                marker, data = await read_frame(reader, max_bytes)
            except asyncio.IncompleteReadError:
                return  # the end of the responses
            if marker == P2P.ERROR_MARKER:
                raise ConnectionError(RPCError.FromString(data).message)
            yield response_type.FromString(data)


class Opening:
    """A stream's opening, as the stream reports it: from then on the holder has ``wait``
    seconds to send its header (``Fetcher._drain``)."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.is_open = False
        self.within: asyncio.Timeout | None = None  # the wait under way for the first message

    def opened(self) -> None:
        self.is_open = True
        if self.within is not None and not self.within.expired():
            self.within.reschedule(asyncio.get_running_loop().time() + self.wait)
