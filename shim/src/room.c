/*
 * room.c: the workspace a convolution may take now, from the memory free at that moment
 * (SuperNeurons' rule: a convolution's workspace is whatever is free when it runs), and the front
 * point that fits it.
 *
 * A front plan lets the shim trade speed for workspace. The framework's own choice (its engine's
 * workspace, or what a legacy caller allocated) says how much workspace it would take, not whether
 * that much is free: under memory pressure a large workspace fails to allocate (an out-of-memory
 * error) or fragments the caching allocator for what follows. So when the point the shim would
 * choose needs more than the room, it chooses the fastest point within the room instead, or the
 * smallest: the room only ever lowers the workspace chosen, and with plenty of memory nothing
 * changes.
 *
 * The room is read when a choice is made: at cudnnBackendFinalize of an execution plan (a
 * framework allocates the workspace the plan reports right after, and reuses the plan), and at
 * each algorithm query. The device's free memory does not see inside a framework's caching
 * allocator: blocks it holds free count as used, yet the framework hands them out first (and
 * releases them to retry an allocation that failed); and a budget given to the framework's
 * allocator (`mucudnn run --memory-budget` sets PyTorch's memory fraction) limits what it holds,
 * not the CUDA context and libraries beside it. A framework can say what its allocator holds and
 * uses through mucudnn_set_allocator (mucudnn's PyTorch site registers PyTorch's under a budget):
 * what it holds free counts as free, and the budget left is the budget less what it uses. Without
 * it the room errs on the small side, by the cache and the context.
 *
 * Where no point is chosen (no plan for the kernel, or one the framework's engine cannot use), an
 * execution plan whose engine needs more workspace than the room is refused at finalize, as the hard
 * limit refuses one over it, and the framework takes its next engine configuration: one of less
 * workspace, down to a workspace-free engine, which is never refused.
 */
#include <stdint.h>
#include <stdio.h>

#include "internal.h"

static atomic_size_t degraded_kernels, refused_kernels;
/* describe_budget's text: "N left of the allocator's, M free in its cache" at most */
#define BUDGET_TEXT_MAX 112
static _Atomic(mucudnn_allocator_fn) framework_allocator;

MU_EXPORT void mucudnn_set_allocator(mucudnn_allocator_fn fn) { atomic_store(&framework_allocator, fn); }

/* The room from the device's view (allocator unknown) or, with `allocated` and `reserved`, the
 * framework allocator's. */
static void settle(mu_room_info *room, size_t free_bytes, size_t used, bool allocator_known, size_t reserved,
                   size_t allocated) {
    room->allocator_known = allocator_known;
    room->cached_bytes = 0;
    if (allocator_known) {
        room->cached_bytes = reserved - allocated;
        if (room->cached_bytes > used) room->cached_bytes = used;  /* it holds no more than is used */
        used = allocated;
    }
    room->free_bytes = free_bytes + room->cached_bytes;
    room->budget_left = SIZE_MAX;
    long long budget = mu_option_int(MU_OPT_MEMORY_BUDGET);
    if (budget >= 0) room->budget_left = (size_t)budget > used ? (size_t)budget - used : 0;
    room->margin = (size_t)mu_option_int(MU_OPT_ROOM_MARGIN);
    size_t available = room->free_bytes < room->budget_left ? room->free_bytes : room->budget_left;
    room->bytes = available > room->margin ? available - room->margin : 0;
}

bool mu_room(mu_room_info *room, size_t need) {
    size_t free_bytes = 0, total_bytes = 0;
    if (mu_option_int(MU_OPT_ROOM) == 0 || !mu_device_memory(&free_bytes, &total_bytes)) return false;
    /* In use: everything the device does not have free (this process's context and memory, and
     * other processes' on a shared GPU); with the framework's allocator known, what it has
     * allocated, its budget being the allocator's. */
    size_t used = total_bytes > free_bytes ? total_bytes - free_bytes : 0;
    settle(room, free_bytes, used, false, 0, 0);
    /* The allocator's view is never smaller (what it holds is in use on the device): asked only
     * where the device's view is too small for `need`, so that a workspace that fits anyway
     * costs no call into the framework (a Python callback takes the GIL). */
    mucudnn_allocator_fn fn = atomic_load(&framework_allocator);
    size_t reserved = 0, allocated = 0;
    if (room->bytes < need && fn != NULL && fn(&reserved, &allocated) == 0 && allocated <= reserved)
        settle(room, free_bytes, used, true, reserved, allocated);
    return true;
}

static void describe_budget(const mu_room_info *room, char *buf, size_t size) {
    int n = room->budget_left == SIZE_MAX ? snprintf(buf, size, "none")
                                          : snprintf(buf, size, "%zu left", room->budget_left);
    if (room->allocator_known && n > 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, room->budget_left == SIZE_MAX ? "; the allocator's cache %zu free"
                                                                        : " of the allocator's, %zu free in its cache",
                 room->cached_bytes);
}

void mu_room_note_degraded(mu_seen *seen, const mu_kernel *k, size_t from, size_t to, const mu_room_info *room) {
    bool first = seen == NULL || !atomic_exchange(&seen->degraded, true);
    if (first) atomic_fetch_add(&degraded_kernels, 1);
    char budget[BUDGET_TEXT_MAX];
    describe_budget(room, budget, sizeof budget);
    mu_log(first ? MU_LOG_INFO : MU_LOG_DEBUG, "%s N=%d: degraded for lack of memory: a point of %zu bytes of "
           "workspace instead of %zu (room %zu: free %zu, budget %s, margin %zu)", k->key, k->n, to, from,
           room->bytes, room->free_bytes, budget, room->margin);
}

mu_plan_entry *mu_room_point(mu_plan_entry *head, mu_plan_entry *chosen, bool deterministic,
                             const mu_kernel *k, mu_seen *seen) {
    mu_room_info room;
    if (chosen == NULL || !mu_room(&room, chosen->workspace) || chosen->workspace <= room.bytes) return chosen;
    mu_plan_entry *within = mu_plan_point(head, room.bytes, deterministic);
    if (within == NULL) /* the smallest usable point: the one of least workspace (head first) */
        for (mu_plan_entry *point = head; point != NULL && within == NULL; point = point->next_point)
            if (!atomic_load(&point->disabled) && (!deterministic || mu_plan_legacy_deterministic(point)))
                within = point;
    if (within == NULL || within->workspace >= chosen->workspace) return chosen;
    mu_room_note_degraded(seen, k, chosen->workspace, within->workspace, &room);
    return within;
}

bool mu_room_refuses(size_t workspace, const mu_kernel *k, mu_seen *seen, const void *plan) {
    mu_room_info room;
    /* An engine without workspace always fits: the framework always has one to land on. Refusing
     * needs a budget: without one the room is the device's free memory, where the blocks PyTorch's
     * cache holds free count as used, so a full cache would turn away engines that PyTorch would
     * have fed from it (and where it cannot, its own fallback takes the next engine). */
    if (workspace == 0 || !mu_room(&room, workspace) || room.budget_left == SIZE_MAX || workspace <= room.bytes)
        return false;
    /* Counted per kernel; a convolution without a key has no kernel to count it under. */
    bool first = seen != NULL && !atomic_exchange(&seen->room_refused, true);
    if (first) atomic_fetch_add(&refused_kernels, 1);
    char budget[BUDGET_TEXT_MAX], kernel[MU_KEY_MAX + 32];
    describe_budget(&room, budget, sizeof budget);
    if (k != NULL) snprintf(kernel, sizeof kernel, "%s N=%d", k->key, k->n);
    else snprintf(kernel, sizeof kernel, "graph plan %p", plan);
    mu_log(first ? MU_LOG_INFO : MU_LOG_DEBUG, "%s: an engine of %zu bytes of workspace refused for lack of "
           "memory, the framework takes its next configuration (room %zu: free %zu, budget %s, margin %zu)",
           kernel, workspace, room.bytes, room.free_bytes, budget, room.margin);
    return true;
}

size_t mu_room_degraded_kernels(void) { return atomic_load(&degraded_kernels); }

size_t mu_room_refused_kernels(void) { return atomic_load(&refused_kernels); }
