"""trimkit inside LangChain (:mod:`.langchain`) and LlamaIndex (:mod:`.llamaindex`), each importing
its framework only when imported itself (``docs/integrations.md``). Shared here: trimkit's server
errors as the ``openai`` errors the frameworks' OpenAI clients raise (:func:`as_openai_error`, :func:`openai_errors`)."""
import contextlib
import functools
from collections.abc import Iterator

from trimkit.errors import BackendError, ServerError, ServerTimeoutError, ServerUnreachableError


@functools.cache
def _both(trimkit_type: type, openai_type: type) -> type:
    """An exception type that is both ``trimkit_type`` and ``openai_type`` (one per pair)."""
    return type(trimkit_type.__name__, (trimkit_type, openai_type), {"__module__": trimkit_type.__module__})


@contextlib.contextmanager
def openai_errors(base_url: str | None, convert: bool = True) -> Iterator[None]:
    """Inside, a trimkit ``BackendError`` is raised as :func:`as_openai_error` makes it (``convert`` False: as it is)."""
    try:
        yield
    except BackendError as exc:
        if not convert:
            raise
        raise as_openai_error(exc, base_url) from exc


def as_openai_error(exc: BaseException, base_url: str | None = None) -> BaseException:
    """A trimkit ``BackendError`` as the ``openai`` error the raw client raises for the same failure (its type
    subclasses both; mapping in ``docs/integrations.md``) on the server at ``base_url``; anything else as it is."""
    try:
        import httpx
        import openai
    except ImportError:  # pragma: no cover - ChatOpenAI needs both
        return exc
    if not isinstance(exc, BackendError) or isinstance(exc, openai.APIError):
        return exc
    request = httpx.Request("POST", str(base_url or "http://localhost/v1").rstrip("/") + "/chat/completions")
    status = getattr(exc, "status", None)
    if isinstance(exc, ServerTimeoutError):
        base: type = openai.APITimeoutError
    elif isinstance(exc, ServerUnreachableError):
        base = openai.APIConnectionError
    elif isinstance(exc, ServerError) and isinstance(status, int) and status >= 400:
        base = {400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
                404: openai.NotFoundError, 409: openai.ConflictError, 422: openai.UnprocessableEntityError,
                429: openai.RateLimitError}.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    else:
        base = openai.APIError
    # only the trimkit error's __init__ runs (it ends in the builtin exception's): the openai fields are set here
    trimkit_type: type = type(exc)  # hashable, as the cache wants it
    new = _both(trimkit_type, base)(str(exc))
    new.__dict__.update(exc.__dict__)
    new.args = exc.args
    new.message = str(exc)
    new.request = request
    new.body = getattr(exc, "server_message", None) or None
    new.code = new.param = new.type = None
    if issubclass(base, openai.APIStatusError) and isinstance(status, int):
        new.response = httpx.Response(status, request=request)
        new.status_code = status
        new.request_id = None
    return new.with_traceback(exc.__traceback__)
