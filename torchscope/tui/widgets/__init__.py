"""One widget per module."""

from torchscope.tui.widgets.alert_list import AlertList
from torchscope.tui.widgets.detail_panel import DetailPanel
from torchscope.tui.widgets.filter_input import FilterInput
from torchscope.tui.widgets.graph_tree import GraphTree
from torchscope.tui.widgets.op_timeline import OpTimeline
from torchscope.tui.widgets.status_bar import StatusBar
from torchscope.tui.widgets.step_list import StepList
from torchscope.tui.widgets.virtual_list import VirtualList

__all__ = [
    "AlertList",
    "DetailPanel",
    "FilterInput",
    "GraphTree",
    "OpTimeline",
    "StatusBar",
    "StepList",
    "VirtualList",
]
