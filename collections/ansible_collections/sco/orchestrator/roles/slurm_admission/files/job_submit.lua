--[[
SCO admission for Slurm: job_submit/lua (JobSubmitPlugins=lua; this file beside slurm.conf).

On reclaimable partitions every job must name its workload contract in its comment:
    sbatch --comment=sco-contract=<name> ...
Why the comment: every Slurm client (sbatch, salloc, srun) can set it, it needs no accounting database
(unlike --wckey), squeue and sacct show it, and it survives a requeue. Other comment text may stand beside
the key, separated by spaces or ';'.

The job is refused, with one line telling the user what to add, when it names no contract, a contract absent
from the signed bundle, or a contract whose account or partitions do not match. Accepted jobs are forced
requeueable (requeue=1) so a drain can put them back in the queue.

Contract data comes from sco_contracts.lua (rendered from the verified bundle by `sco slurm render-contracts`,
written atomically, with its serial in sco_contracts.serial). This script runs under slurmctld's locks, so it
reads only the one-line serial file, at most every RECHECK_S seconds, and reloads the table only when the
serial changed. Without contract data it fails closed: work without a known drain budget is never placed.
--]]

local RECHECK_S = 5

local function here()
  local src = debug.getinfo(1, "S").source
  return (src:sub(1, 1) == "@" and src:match("^@(.*)/[^/]*$")) or "/etc/slurm"
end

local DIR = here()
local CONTRACTS_FILE = DIR .. "/sco_contracts.lua"
local SERIAL_FILE = DIR .. "/sco_contracts.serial"

local cache, cache_serial, checked_at = nil, nil, -RECHECK_S

local function read_serial()
  local f = io.open(SERIAL_FILE, "r")
  if not f then return nil end
  local s = f:read("*l")
  f:close()
  return s
end

local function contracts()
  local now = os.time()
  if cache ~= nil and now - checked_at < RECHECK_S then return cache end
  checked_at = now
  local serial = read_serial()
  if cache ~= nil and serial == cache_serial then return cache end
  local chunk, err = loadfile(CONTRACTS_FILE)
  if not chunk then
    slurm.log_error("sco: cannot load %s: %s (keeping the last good table)", CONTRACTS_FILE, tostring(err))
    return cache
  end
  local ok, t = pcall(chunk)
  if ok and type(t) == "table" and type(t.contracts) == "table" then
    cache, cache_serial = t, serial
  else
    slurm.log_error("sco: %s did not return a contract table (keeping the last good one)", CONTRACTS_FILE)
  end
  return cache
end

local function default_partition(part_list)
  for _, part in pairs(part_list or {}) do
    if part.flag_default == 1 or part.flag_default == true then return part.name end
  end
  return nil
end

local function refuse(msg)
  slurm.log_user("%s", msg)
  return slurm.ERROR
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local c = contracts()
  if c == nil then
    return refuse("sco: contract data is missing on the controller (sco_contracts.lua); ask the platform team")
  end
  local partitions = job_desc.partition or default_partition(part_list) or ""
  local reclaimable = false
  for p in string.gmatch(partitions, "[^,]+") do
    if c.reclaimable[p] then reclaimable = true end
  end
  local name = job_desc.comment and string.match(job_desc.comment, "sco%-contract=([%w%-%.]+)")
  if not reclaimable and name == nil then return slurm.SUCCESS end
  if name == nil then
    local hint = ""
    local acct = job_desc.account and c.by_account[job_desc.account]
    if acct then hint = " (contracts for account " .. job_desc.account .. ": " .. table.concat(acct, ", ") .. ")" end
    return refuse("sco: partition " .. partitions .. " is reclaimable: add --comment=sco-contract=<name>" .. hint)
  end
  local k = c.contracts[name]
  if k == nil then
    return refuse("sco: contract " .. name .. " is not in bundle serial " .. tostring(c.serial)
                  .. " (hall " .. c.hall .. "): check the name or ask for it to be added")
  end
  if job_desc.account ~= k.account then
    return refuse("sco: contract " .. name .. " is for account " .. k.account .. ": add --account=" .. k.account)
  end
  if not k.all_partitions then
    for p in string.gmatch(partitions, "[^,]+") do
      if not k.partitions[p] then
        return refuse("sco: contract " .. name .. " does not cover partition " .. p .. ": use --partition="
                      .. k.partition_list)
      end
    end
  end
  job_desc.requeue = 1
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
