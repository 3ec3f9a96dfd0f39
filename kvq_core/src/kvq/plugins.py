"""The capability registry: methods, implementations, and entry-point discovery.

kvq owns one :class:`pluggy.PluginManager`. Entry points in group ``kvq`` are loaded on first use, each under
its own guard: a plugin that fails to import, has no ``kvq_register``, registers something malformed, or
whose hooks have the wrong signature is named in a :class:`PluginLoadWarning` and skipped (all of what it
registered is rolled back). ``KVQ_STRICT_PLUGINS=1`` (or ``load(strict=True)``) turns that into an error.
``KVQ_LOAD_PLUGINS=a,b`` loads only the named entry points (empty: none), like llm's ``LLM_LOAD_PLUGINS``, and
kvq-core's own (:data:`CORE_ENTRY_POINT`: ``fp16``, kvq's 16-bit cache, and ``affine``).
"""

from __future__ import annotations

import difflib
import inspect
import os
import types
import warnings
from importlib.metadata import entry_points
from typing import Any, Iterable

import pluggy

from . import hookspecs
from .hookspecs import OPS
from .install_hints import method_hint
from .declaration import Method

GROUP = "kvq"
#: kvq-core's own entry point (the ``fp16`` and ``affine`` baselines): loaded whatever ``KVQ_LOAD_PLUGINS`` names.
CORE_ENTRY_POINT = ("baselines", "kvq.baselines")
#: ``Implementation.method`` value of implementations that serve every method (bit packing).
ANY_METHOD = "*"
_SPEC_NAMES = {n for n in dir(hookspecs) if n.startswith("kvq_")}
#: op -> hook names an implementation must define to serve it.
OP_HOOKS = {"quantize": ("kvq_quantize",), "dequantize": ("kvq_dequantize",), "attend": ("kvq_attend",),
            "pack": ("kvq_pack", "kvq_unpack")}


class UnknownMethodError(ValueError):
    """A method name no installed plugin declares (:meth:`Registry.method`): the message lists the installed ones."""


class RegistrationError(ValueError):
    """A method or implementation object that kvq cannot accept (the message says why)."""


class PluginLoadWarning(UserWarning):
    """A kvq plugin that was skipped because it failed to load or register."""


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager that also accepts undecorated ``kvq_*`` methods as hook implementations."""

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("kvq_") and callable(getattr(plugin, name, None)):
            return {}
        return opts


def implemented_ops(impl: Any) -> tuple[str, ...]:
    """The ops (``quantize``, ``dequantize``, ``attend``, ``pack``) that ``impl`` defines every hook of."""
    return tuple(op for op in OPS if all(callable(getattr(impl, h, None)) for h in OP_HOOKS[op]))


def _check_hook_names(obj: Any) -> None:
    for name in dir(obj):
        if name.startswith("kvq_") and name not in _SPEC_NAMES:
            near = difflib.get_close_matches(name, sorted(_SPEC_NAMES), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise RegistrationError(f"{obj!r} defines unknown hook {name}{hint}; known: {', '.join(sorted(_SPEC_NAMES))}")
        if name in _SPEC_NAMES and callable(getattr(obj, name)):
            _check_takes_every_argument(obj, name)


def _check_takes_every_argument(obj: Any, name: str) -> None:
    """:raises RegistrationError: a hook of ``obj`` that does not take every argument of its spec. pluggy refuses
    arguments the spec lacks, not missing ones, and kvq calls a chosen implementation's hook with all of them: a
    new user's ``kvq_quantize(self, x)`` registered and failed only at the cache's first compression."""
    want = list(inspect.signature(getattr(hookspecs, name)).parameters)
    try:
        have = inspect.signature(getattr(obj, name)).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in have.values()):
        return
    # kvq passes every argument positionally: a keyword-only one counts as missing
    missing = [a for a in want if a not in have or have[a].kind is inspect.Parameter.KEYWORD_ONLY]
    if missing:
        raise RegistrationError(f"{obj!r}: {name}({', '.join(have)}) lacks the argument(s) {', '.join(missing)}; kvq "
                                f"calls it as {name}({', '.join(want)})")


def _check_implementation(obj: Any) -> None:
    for attr in ("method", "backend"):
        if not isinstance(getattr(obj, attr, None), str):
            raise RegistrationError(f"implementation {obj!r} needs a string attribute {attr!r}")
    for attr in ("supports", "cost"):
        if not callable(getattr(obj, attr, None)):
            raise RegistrationError(f"implementation {obj!r} needs a method {attr}(problem)")
        try:
            inspect.signature(getattr(obj, attr)).bind(None)
        except TypeError:
            raise RegistrationError(f"implementation {obj!r}: {attr} must take one argument, the problem "
                                    f"({attr}(problem))") from None
        except ValueError:  # no signature to read
            pass
    if not implemented_ops(obj):
        raise RegistrationError(f"implementation {obj!r} implements none of the op hooks {', '.join(sorted(_SPEC_NAMES - {'kvq_register'}))}")


class Registry:
    """Methods and implementations known to kvq, and the pluggy manager that validated them."""

    def __init__(self) -> None:
        self.pm = _PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.methods: dict[str, Method] = {}
        self.implementations: dict[tuple[str, str], Any] = {}
        self.origin: dict[Any, str] = {}  # method name or (method, backend) -> who registered it
        self.failures: dict[str, str] = {}  # entry point name -> error message
        self.not_loaded: set[str] = set()  # entry points KVQ_LOAD_PLUGINS left out
        self.plugins: dict[str, list] = {}  # plugin name (entry-point:<name>, module:<name>) -> what it registered
        self.generation = 0  # bumped on every change; selection caches key on it
        self.loaded = False

    # -- registration -------------------------------------------------------------------------------
    def register(self, obj: Any, origin: str = "kvq.register") -> Any:
        """Register a :class:`Method` declaration or an implementation object; returns ``obj``.

        :raises RegistrationError: a duplicate name, a missing attribute, an unknown hook name.
        :raises pluggy.PluginValidationError: a hook whose argument names are not in its spec.
        """
        if isinstance(obj, Method):
            if obj.name in self.methods:
                raise RegistrationError(f"method {obj.name!r} is already registered by {self.origin[obj.name]}")
            if getattr(obj.params_class, "method", None) != obj.name:
                raise RegistrationError(f"{obj.params_class.__name__}.method must equal the method name {obj.name!r}")
            self.methods[obj.name] = obj
            self.origin[obj.name] = origin
        else:
            _check_implementation(obj)
            _check_hook_names(obj)
            key = (obj.method, obj.backend)
            if key in self.implementations:
                raise RegistrationError(f"implementation {key[0]}:{key[1]} is already registered by {self.origin[key]}")
            self.pm.register(obj, name=f"{obj.method}:{obj.backend}")  # validates hook signatures
            self.implementations[key] = obj
            self.origin[key] = origin
        self.generation += 1
        return obj

    def unregister(self, obj: Any) -> None:
        """Remove a method declaration or implementation object (tests use this to clean up)."""
        if isinstance(obj, Method):
            self.methods.pop(obj.name, None)
            self.origin.pop(obj.name, None)
        else:
            key = (obj.method, obj.backend)
            if self.implementations.get(key) is obj:
                del self.implementations[key]
                self.origin.pop(key, None)
                self.pm.unregister(obj)
        self.generation += 1

    def register_plugin(self, module: Any, name: str, origin: str) -> list:
        """Register everything ``module.kvq_register(register)`` hands over, all or nothing (an entry point's module,
        or one given to :func:`register`); returns what was registered.

        :param name: the plugin's name with the plugin manager (``entry-point:<name>``, ``module:<name>``).
        :raises RegistrationError: no ``kvq_register`` function, or what :meth:`register` raises for an object it
            hands over (everything registered before is rolled back).
        :raises pluggy.PluginValidationError: ``kvq_register``'s or a hook's arguments not in its spec.
        """
        if name in self.plugins or self.pm.has_plugin(name):
            raise RegistrationError(f"plugin {name} is already registered (kvq.unregister it first)")
        done: list[Any] = []
        try:
            if not callable(getattr(module, "kvq_register", None)):
                raise RegistrationError(f"{getattr(module, '__name__', module)} has no kvq_register(register) "
                                        f"function")
            self.pm.register(module, name=name)  # validates kvq_register's signature
            staged: list[Any] = []
            module.kvq_register(register=staged.append)
            for obj in staged:
                done.append(self.register(obj, origin=origin))
        except Exception:
            for obj in done:
                self.unregister(obj)
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            raise
        self.plugins[name] = done
        return done

    # -- discovery ----------------------------------------------------------------------------------
    def load_entry_points(self, strict: bool | None = None) -> None:
        """Load every entry point of group ``kvq`` (once), each under its own guard; under ``KVQ_LOAD_PLUGINS`` the
        named ones and kvq-core's own (a new user's ``KVQ_LOAD_PLUGINS=myplugin kvq generate`` lost fp16, the
        method its report compares with)."""
        if self.loaded:
            return
        self.loaded = True
        strict = os.environ.get("KVQ_STRICT_PLUGINS", "") not in ("", "0") if strict is None else strict
        only = os.environ.get("KVQ_LOAD_PLUGINS")
        allowed = None if only is None else {n.strip() for n in only.split(",") if n.strip()}
        for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
            if allowed is None or ep.name in allowed or (ep.name, ep.value) == CORE_ENTRY_POINT:
                self._load_one(ep, strict)
            else:
                self.not_loaded.add(ep.name)

    def _load_one(self, ep, strict: bool) -> None:
        try:
            self.register_plugin(ep.load(), f"entry-point:{ep.name}", f"plugin {ep.name!r}")
        except Exception as exc:  # a broken plugin must never take kvq down
            reason = f"{type(exc).__name__}: {exc}"
            if strict:
                raise RegistrationError(f"kvq plugin {ep.name!r} ({ep.value}) failed to load, and strict plugin "
                                        f"loading is on (KVQ_STRICT_PLUGINS): {reason}") from exc
            message = f"kvq plugin {ep.name!r} ({ep.value}) was skipped: {reason}"
            self.failures[ep.name] = message
            warnings.warn(message, PluginLoadWarning, stacklevel=3)

    # -- queries ------------------------------------------------------------------------------------
    def method(self, name: str) -> Method:
        """The declaration of ``name``.

        :raises UnknownMethodError: (a ValueError) unknown name: lists the installed methods and, for a method of one of kvq's own
            distributions that is not installed, names it and the command that installs it
            (:func:`kvq.install_hints.method_hint`)."""
        if name not in self.methods:
            known = ", ".join(sorted(self.methods)) or "(none installed)"
            hint = method_hint(name) if isinstance(name, str) else ""
            keys, plus, values = name.partition("+") if isinstance(name, str) else ("", "", "")
            if plus and not hint:  # kvq eval's spelling of keys and values apart, "qjl+affine:4"
                hint = (f"{name!r} is a method string of kvq eval; here give each side its method: "
                        f"key_method={keys.partition(':')[0]!r}, value_method={values.partition(':')[0]!r}, with "
                        f"key_params / value_params for their parameters (kvq generate: --key-method, --value-method)")
            base, colon, bits = name.partition(":") if isinstance(name, str) else ("", "", "")
            if colon and base in self.methods and not hint:  # the CLI's spelling, "turboquant:3"
                numeric = bits.replace(".", "", 1).isdigit()
                hint = (f"{name!r} is a method string (kvq eval, kvq generate --method); here give the method and "
                        f"its bits apart: method={base!r}, bits={bits} (kvq select: {base} --param bits={bits}; "
                        f"kvq.make_prompt_cache takes the string as it is)"
                        if numeric else
                        f"{name!r} is a method string (kvq eval, kvq generate --method); here give the method and "
                        f"its parameters apart (method={base!r}, ...)")
            raise UnknownMethodError(f"method must be one of {known}; got {name!r}" + (f" ({hint})" if hint else ""))
        return self.methods[name]

    def implementations_of(self, method: str, op: str) -> list[Any]:
        """Implementations that serve ``op`` for ``method`` (generic ones for ``pack`` included)."""
        return [impl for (m, _), impl in sorted(self.implementations.items())
                if m in (method, ANY_METHOD) and op in implemented_ops(impl)]


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """kvq's process-wide :class:`Registry` (methods and their implementations by back end), with the entry points
    of group ``kvq`` loaded on first use (``KVQ_LOAD_PLUGINS`` limits them; ``KVQ_STRICT_PLUGINS=1`` makes a plugin
    that fails to load an error, :class:`RegistrationError`, instead of a warning)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    _REGISTRY.load_entry_points()
    return _REGISTRY


def plugin_manager() -> pluggy.PluginManager:
    """kvq's :class:`pluggy.PluginManager` (entry points loaded): the specs of :mod:`kvq.hookspecs`, each entry-point
    module (named ``"entry-point:NAME"``) and each implementation object (``"METHOD:BACKEND"``).

    For broadcast calls, which call one hook of every registered implementation at once and return their results in
    a list (parity checks; the hot path uses :func:`kvq.select`'s bound callables instead). Hook calls take keyword
    arguments only: ``kvq.plugin_manager().hook.kvq_pack(codes=codes, bits=3)``. Register and unregister through
    :func:`register`/:func:`unregister`, not through the manager, so that kvq's registry stays in step.
    """
    return registry().pm


def register(obj: Any) -> Any:
    """Register what is not installed as an entry point: a :class:`Method`, an implementation object, or a plugin
    module (one with ``kvq_register(register)``, as an entry point's: everything it registers, all or nothing).

    Returns ``obj`` (so it can be used as a decorator on a class instance factory). Errors as
    :meth:`Registry.register` and :meth:`Registry.register_plugin`.
    """
    if isinstance(obj, types.ModuleType):
        registry().register_plugin(obj, f"module:{obj.__name__}", f"kvq.register({obj.__name__})")
        return obj
    return registry().register(obj)


def unregister(obj: Any) -> None:
    """Undo :func:`register` (for a module, of everything it registered)."""
    reg = registry()
    if isinstance(obj, types.ModuleType):
        name = f"module:{obj.__name__}"
        for item in reversed(reg.plugins.pop(name, [])):
            reg.unregister(item)
        if reg.pm.has_plugin(name):
            reg.pm.unregister(name=name)
        return
    reg.unregister(obj)


def methods() -> dict[str, Method]:
    """Installed methods, by name: ``{"turboquant": Method(...), ...}`` (a copy; :class:`kvq.Method` declares each
    method's parameter class, bits accounting and description). Loads the entry points on first use
    (:func:`registry`); a plugin that fails to load is left out with a warning naming it."""
    return dict(registry().methods)


def make_params(method: str, **kwargs: Any):
    """Validated parameters for ``method`` (see :meth:`Method.make_params`).

    :raises ValueError: unknown method (the message lists the installed ones) or a value out of range.
    :raises TypeError: an unknown parameter name.
    """
    return registry().method(method).make_params(**kwargs)


def all_implementations() -> Iterable[Any]:
    """Every registered implementation object."""
    return list(registry().implementations.values())
