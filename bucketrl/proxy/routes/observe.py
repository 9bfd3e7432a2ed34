"""Being written (P2)."""

from fastapi import APIRouter

router = APIRouter()
