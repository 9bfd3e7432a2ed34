"""Placeholder (P3 fills this module)."""

from fastapi import APIRouter

router = APIRouter()
