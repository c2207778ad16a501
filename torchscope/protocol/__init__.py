"""Wire and file formats shared by the tracer and the UI.

Imports neither torch nor textual: a UI on a laptop reads what a tracer on a cluster wrote.
"""

from torchscope.protocol.codec import PROTOCOL_VERSION, ProtocolError, pack, unpack
from torchscope.protocol.events import KINDS, Event

__all__ = ["KINDS", "PROTOCOL_VERSION", "Event", "ProtocolError", "pack", "unpack"]
