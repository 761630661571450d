"""trimkit inside the RAG frameworks people already use: :mod:`trimkit.integrations.langchain`
(``trimkit[langchain]``) and :mod:`trimkit.integrations.llamaindex` (``trimkit[llamaindex]``),
each importing its framework only when imported itself, so ``import trimkit`` needs neither.
Each converts its framework's messages and documents and sends them through :func:`trimkit.wrap`
on the engine the framework's model already talks to (``docs/integrations.md``).

What both share, without a framework: trimkit's server errors as the ``openai`` errors the
frameworks' OpenAI clients raise (:func:`as_openai_error`).
"""
import threading

from trimkit.errors import BackendError, ServerError, ServerTimeoutError, ServerUnreachableError

#: the base URL an error's request names when the server's is not known
_DEFAULT_BASE_URL = "http://localhost/v1"
#: the exception types made so far, one per (trimkit type, openai type)
_BOTH: dict[tuple[type, type], type] = {}
_BOTH_LOCK = threading.Lock()


def _both(trimkit_type: type, openai_type: type) -> type:
    """An exception type that is both ``trimkit_type`` and ``openai_type`` (made once per pair)."""
    with _BOTH_LOCK:
        made = _BOTH.get((trimkit_type, openai_type))
        if made is None:
            made = _BOTH[(trimkit_type, openai_type)] = type(trimkit_type.__name__, (trimkit_type, openai_type),
                                                              {"__module__": trimkit_type.__module__})
        return made


def chat_completions_url(base_url: str | None) -> str:
    """The chat completions URL of a server at ``base_url`` (None or empty: a local default), the
    request an ``openai`` error names."""
    return str(base_url or _DEFAULT_BASE_URL).rstrip("/") + "/chat/completions"


def as_openai_error(exc: BaseException, url: str = _DEFAULT_BASE_URL + "/chat/completions") -> BaseException:
    """A trimkit backend error as the ``openai`` error the raw client raises for the same
    failure, still the trimkit error (its type subclasses both): ``ServerTimeoutError`` →
    ``openai.APITimeoutError``, ``ServerUnreachableError`` → ``openai.APIConnectionError``, a
    ``ServerError`` with an HTTP status → ``openai.APIStatusError``'s subclass for it
    (``BadRequestError``, ``RateLimitError``, ``InternalServerError``, ...), any other
    ``BackendError`` (an interrupted stream, a malformed reply) → ``openai.APIError``. Anything
    else is returned as it is."""
    try:
        import httpx
        import openai
    except ImportError:  # pragma: no cover - ChatOpenAI needs both
        return exc
    if not isinstance(exc, BackendError) or isinstance(exc, openai.APIError):
        return exc
    request = httpx.Request("POST", url)
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
    # the trimkit error's __init__ (its keywords have defaults) ends in the builtin exception's,
    # which calls no further __init__: the openai one is not run, its fields are set below
    new = _both(type(exc), base)(str(exc))
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
