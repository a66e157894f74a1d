"""adapters/patching.py: a patched object's attribute (a model's forward) holds its owner weakly and ends with it."""

import gc
import types
import weakref

from octopipe_plugin.adapters.patching import Patches


class Layer:
    def forward(self):
        return "class"

    def __init__(self):
        self.impl = self.forward  # an attribute of its own, a method bound to it (as Megatron's _forward_impl)
        self.plain = lambda: "plain"


def test_an_object_patch_does_not_keep_its_owner_and_ends_with_it():
    patches = Patches("test")
    layer = Layer()
    owner = weakref.ref(layer)
    for name in ("forward", "impl", "plain"):
        patches.replace(layer, name, lambda orig: (lambda: "new " + orig()), f"why {name}")
    assert (layer.forward(), layer.impl(), layer.plain()) == ("new class", "new class", "new plain")
    assert patches.installed() == ["Layer.forward: why forward", "Layer.impl: why impl", "Layer.plain: why plain"]
    assert patches.original(layer, "impl")() == "class" and patches.is_replaced(layer, "forward")
    del layer
    gc.collect()
    assert owner() is None and patches.installed() == []  # freed, and a later object at its id is not "patched"


def test_uninstall_restores_objects_and_modules():
    patches = Patches("test")
    layer, module = Layer(), types.ModuleType("m")
    module.f = lambda: "module"
    for name in ("forward", "impl", "plain"):
        patches.replace(layer, name, lambda orig: (lambda: "new"), "why")
    patches.replace(module, "f", lambda orig: (lambda: "new"), "why")
    patches.uninstall()
    assert (layer.forward(), layer.impl(), layer.plain(), module.f()) == ("class", "class", "plain", "module")
    assert "forward" not in vars(layer) and layer.impl.__self__ is layer and patches.installed() == []
