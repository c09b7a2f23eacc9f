"""The engine's unfinished requests, and the outputs due before its next step.

A request asks for `n` samples: it is one parent id over `n` child requests (the scheduler's unit), and
its output (`output_of`) carries one completion per child. `RequestTable` maps both ids; an output that
is finished takes its request out of the table.

Outputs made between steps (an imported request's first token, a grammar that failed to compile, an
import aborted while its KV loaded) wait in `DueOutputs` and go out with the next step's.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.engine.request import Request, RequestOutput, output_of


class DueOutputs:
    """Outputs made between steps, returned by the next step before its own. An imported request's first
    token goes out alone, without waiting for a forward pass (its stream's first line is its TTFT), at
    most once in a row: the step after runs the model, whatever is due."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self._first_token = False  # an import's first token is among them
        self._ran_last = True  # the last step ran the model (it did not return these alone)

    def __bool__(self) -> bool:
        return bool(self.outputs)

    def post(self, output: RequestOutput, first_token: bool = False) -> None:
        self.outputs.append(output)
        self._first_token = self._first_token or first_token

    def take(self) -> tuple[list[RequestOutput], bool]:
        """-> (the outputs due, whether the step returns them alone now, before it runs the model)."""
        outputs, self.outputs = self.outputs, []
        alone = self._first_token and self._ran_last
        self._first_token, self._ran_last = False, not alone
        return outputs, alone

    def put_back(self, outputs: list[RequestOutput]) -> None:
        """A step that raised: its due outputs go out with the next one, first."""
        self.outputs[:0] = outputs

    def run_model_next(self) -> None:
        """The next step runs the model even if an import's first token is due."""
        self._ran_last = False


class RequestTable:
    """Unfinished requests by parent id (each a list of its `n` children) and by child id."""

    def __init__(self) -> None:
        self.parents: dict[str, list[Request]] = {}
        self.requests: dict[str, Request] = {}  # every child, by its own id
        self.due = DueOutputs()

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def check_free(self, request_id: str) -> None:
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add(self, parent_id: str, children: list[Request]) -> None:
        self.parents[parent_id] = children
        for child in children:
            self.requests[child.request_id] = child

    def pop(self, parent_id: str) -> list[Request]:
        """Take a request out (aborted): -> its children ([] for an unknown id)."""
        children = self.parents.pop(parent_id, [])
        for child in children:
            self.requests.pop(child.request_id, None)
        return children

    def holds(self, req: Request) -> bool:
        return any(c is req for c in self.parents.get(req.parent_id or req.request_id, ()))

    def output(self, parent_id: str) -> RequestOutput:
        """The output of a request (all its n samples); a finished one is forgotten."""
        out = output_of(parent_id, self.parents[parent_id])
        if out.finished:
            self.pop(parent_id)
        return out

    def outputs(self, changed: Iterable[Request]) -> list[RequestOutput]:
        """The output of each request that `changed` touches (a child or more), in the order first seen."""
        parents = dict.fromkeys(req.parent_id or req.request_id for req in changed)
        return [self.output(pid) for pid in parents]


__all__ = ["DueOutputs", "RequestTable"]
