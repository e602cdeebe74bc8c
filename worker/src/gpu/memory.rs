//! How much memory a device has free, for `--vram auto`: wgpu has no query for it, so this asks
//! the driver below it. On Vulkan: the device-local heaps' budget less their usage where the
//! driver offers `VK_EXT_memory_budget` (what this process may still allocate), else their size.
//! Other backends: unknown.

/// Free device-local memory of `adapter`, bytes, when the driver says.
pub fn free_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    #[cfg(not(any(target_os = "macos", target_os = "ios", target_arch = "wasm32")))]
    {
        vulkan_free_bytes(adapter)
    }
    #[cfg(any(target_os = "macos", target_os = "ios", target_arch = "wasm32"))]
    {
        let _ = adapter;
        None
    }
}

#[cfg(not(any(target_os = "macos", target_os = "ios", target_arch = "wasm32")))]
fn vulkan_free_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    use ash::vk;
    // SAFETY: the handle is only read (no object is made or destroyed through it), while the
    // adapter it came from is alive; the instance and physical device are valid for that time.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    let pd = hal.raw_physical_device();
    // SAFETY: `pd` is a physical device of `instance` (above).
    let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.ok()?;
    let has_budget = exts
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(ash::ext::memory_budget::NAME));
    let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
    let mut props = vk::PhysicalDeviceMemoryProperties2::default();
    if has_budget {
        props = props.push_next(&mut budget);
    }
    // SAFETY: as above; `props` and the struct chained to it live across the call.
    unsafe { instance.get_physical_device_memory_properties2(pd, &mut props) };
    let mem = props.memory_properties;
    let heaps = &mem.memory_heaps[..(mem.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS)];
    let mut free = 0u64;
    for (i, h) in heaps.iter().enumerate() {
        if !h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) {
            continue;
        }
        free += if has_budget {
            budget.heap_budget[i].saturating_sub(budget.heap_usage[i])
        } else {
            h.size
        };
    }
    (free > 0).then_some(free)
}
