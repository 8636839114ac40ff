"""``/v1/audit``: the log as a Merkle tree for an outsider: the signed checkpoint and the
inclusion and consistency proofs (docs/audit.md, "Merkle tree"), the same documents as
``audit checkpoint --sign-key --json`` and ``audit prove --json``; bytes are base64.

The checkpoint is signed with the key of ``SECONDBOX_CHECKPOINT_KEY`` (the key itself or
its file, read at each request, so a rotated file takes effect at once); without one the
route answers 404 ``no_checkpoint_key``. Reading roles only (auditor, control-plane,
admin): each answer brings the tree up to date first, which reads only the events after
it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from starlette.responses import Response

from secondbox_scheduler.infrastructure.audit.merkle_log import (
    CheckpointKeyMissingError,
    b64,
    consistency_proof,
    inclusion_proof,
    signed_checkpoint,
)
from secondbox_scheduler.infrastructure.audit.signed_notes import NoteError, load_signer
from secondbox_scheduler.infrastructure.http.common import (
    INT64_MAX,
    CellName,
    Scheduler,
    cell_log,
    respond,
)
from secondbox_scheduler.infrastructure.http.errors import ERROR_RESPONSES
from secondbox_scheduler.infrastructure.settings import CHECKPOINT_KEY

router = APIRouter(prefix="/v1/audit", tags=["audit"], responses=ERROR_RESPONSES)

Size = Annotated[int, Query(ge=0, le=INT64_MAX)]


class CheckpointOut(BaseModel):
    checkpoint: str = Field(description="The signed note (C2SP tlog-checkpoint).")
    origin: str
    tree_size: int
    root_hash: str = Field(description="base64")


class InclusionProofOut(BaseModel):
    leaf_index: int = Field(description="The event's position - 1.")
    tree_size: int
    leaf_data: str = Field(description="base64 of the leaf data (docs/audit.md)")
    inclusion_path: list[str] = Field(description="base64 hashes, leaf to root (RFC 9162)")
    root_hash: str


class ConsistencyProofOut(BaseModel):
    old_size: int
    new_size: int
    old_root: str
    new_root: str
    consistency_path: list[str] = Field(description="base64 hashes (RFC 9162)")


@router.get("/checkpoint", response_model=CheckpointOut, summary="Signed checkpoint")
def checkpoint(served: Scheduler, cell: CellName = None) -> Response:
    """The log's Merkle tree head now, signed (``audit checkpoint --sign-key``)."""
    app = cell_log(served, cell)
    key = app.env.get(CHECKPOINT_KEY) or ""
    if not key:
        raise CheckpointKeyMissingError()
    try:
        signer = load_signer(key)
    except NoteError as error:
        raise CheckpointKeyMissingError(str(error)) from None
    note, body = signed_checkpoint(app, signer)
    return respond(
        CheckpointOut(
            checkpoint=str(note), origin=body.origin, tree_size=body.size, root_hash=b64(body.root)
        )
    )


@router.get(
    "/proofs/inclusion", response_model=InclusionProofOut, summary="Inclusion proof of an event"
)
def inclusion(
    served: Scheduler,
    position: Annotated[int, Query(ge=1, le=INT64_MAX, description="The event's position.")],
    size: Annotated[
        int | None, Query(ge=1, le=INT64_MAX, description="The tree size (default: now).")
    ] = None,
    cell: CellName = None,
) -> Response:
    """That the event at ``position`` is leaf ``position - 1`` of the tree (``audit prove
    --position``)."""
    proof = inclusion_proof(cell_log(served, cell), position, size)
    return respond(InclusionProofOut.model_validate(proof.to_dict()))


@router.get(
    "/proofs/consistency",
    response_model=ConsistencyProofOut,
    summary="Consistency proof between two tree sizes",
)
def consistency(
    served: Scheduler,
    old_size: Annotated[
        int, Query(alias="from", ge=0, le=INT64_MAX, description="The older tree size.")
    ],
    new_size: Annotated[
        int | None,
        Query(alias="to", ge=0, le=INT64_MAX, description="The newer tree size (default: now)."),
    ] = None,
    cell: CellName = None,
) -> Response:
    """That the tree of size ``to`` extends the tree of size ``from`` (``audit prove
    --from --to``)."""
    proof = consistency_proof(cell_log(served, cell), old_size, new_size)
    return respond(ConsistencyProofOut.model_validate(proof.to_dict()))
