/**
 * The sidebar's hand-written answer types against the wire's, generated from the server's
 * schema (`../schema`, from autogpu_jupyter/server/schema.py by scripts/wire_schema.py). The
 * checks are types: this file does not compile (ts-jest fails the suite) when the server stops
 * sending a field the sidebar reads, or sends it with a type the sidebar does not expect.
 *
 * `Sends<Wire, Sidebar>`: what the server sends is assignable to what the sidebar declares
 * (every field it reads is there, of a type it accepts). `Same<A, B>`: both ways, for the
 * types that copy the wire as it is. A parsed view that reshapes a field (the cluster's
 * ranking names its devices by label, its history is a Map) is compared less that field.
 */
import * as cluster from '../clustermodel';
import * as model from '../model';
import * as wire from '../schema';

type Sends<Wire, Sidebar> = [Wire] extends [Sidebar] ? true : false;
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;

/** Compiles only for `true`: a check above that fails is a type error here. */
function holds<T extends true>(): T | true {
  return true;
}

describe('the sidebar reads the answers the server sends (type-level)', () => {
  it('devices', () => {
    expect(holds<Same<wire.IProcessJSON, model.IProcess>>()).toBe(true);
    expect(holds<Sends<wire.IDeviceJSON, model.IDevice>>()).toBe(true);
    expect(
      holds<Same<Pick<wire.IDeviceJSON, keyof model.IDevice>, model.IDevice>>()
    ).toBe(true);
    expect(holds<Sends<wire.IDevicesAnswer, model.IFleet>>()).toBe(true);
  });

  it('history', () => {
    expect(holds<Same<wire.IHistorySeries, model.ISeries>>()).toBe(true);
    expect(holds<Same<wire.IHistoryAnswer, model.IHistory>>()).toBe(true);
  });

  it('holders and kernels', () => {
    // model.IHolder's label is `string | null`; the server always sends a string
    expect(holds<Sends<wire.IHolderJSON, model.IHolder>>()).toBe(true);
    expect(
      holds<
        Same<Omit<wire.IHolderJSON, 'label'>, Omit<model.IHolder, 'label'>>
      >()
    ).toBe(true);
    expect(holds<Same<wire.IKernelJSON, model.IKernelInfo>>()).toBe(true);
    expect(holds<Sends<wire.IHoldersAnswer, model.IHolders>>()).toBe(true);
  });

  it('select and move', () => {
    expect(holds<Same<wire.IChosenDevice, model.IChosen>>()).toBe(true);
    expect(holds<Sends<wire.ISelectAnswer, model.ISelection>>()).toBe(true);
    expect(
      holds<
        Same<Pick<wire.ISelectAnswer, keyof model.ISelection>, model.ISelection>
      >()
    ).toBe(true);
    expect(holds<Same<wire.IMoveAnswer, model.IMoveResult>>()).toBe(true);
  });

  it('cluster', () => {
    expect(
      holds<Sends<wire.IClusterDeviceJSON, cluster.IClusterDevice>>()
    ).toBe(true);
    expect(
      holds<
        Same<
          Pick<wire.IClusterDeviceJSON, keyof cluster.IClusterDevice>,
          cluster.IClusterDevice
        >
      >()
    ).toBe(true);
    expect(holds<Sends<wire.IClusterHostJSON, cluster.IClusterHost>>()).toBe(
      true
    );
    // the parsed ranking names a host's chosen devices by label; the wire sends the devices
    expect(
      holds<
        Same<
          Omit<wire.IHostRank, 'chosen'>,
          Omit<cluster.IClusterRank, 'chosen'>
        >
      >()
    ).toBe(true);
    expect(
      holds<
        Sends<
          Omit<wire.IClusterAnswer, 'ranking'>,
          Omit<cluster.ICluster, 'ranking'>
        >
      >()
    ).toBe(true);
    expect(holds<Sends<wire.IHostHistoryJSON, cluster.IHostHistory>>()).toBe(
      true
    );
    // the parsed history keys the hosts by name (a Map)
    expect(
      holds<
        Sends<
          Omit<wire.IClusterHistoryAnswer, 'hosts'>,
          Omit<cluster.IClusterHistory, 'hosts'>
        >
      >()
    ).toBe(true);
  });
});
