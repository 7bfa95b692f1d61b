// Creates (or updates) a tenant's SCRAM user and its ACLs on a secure-profile broker, with Kafka's own
// Java admin client (aiokafka's admin has no ACL or SCRAM API). Run as a single-file program:
//   java -cp 'infra/kafka/lib/*' infra/kafka/TenantAcls.java BOOTSTRAP ADMIN_PASSWORD_FILE TENANT < TENANT_PASSWORD
// Neither password is an argument (arguments are visible to every local user in `ps`): the admin's is read
// from its file (mode 600, written by start.sh), the tenant's from the first line of standard input.
// The tenant may write requests (llm.requests) and cancellations (llm.control), and read only its own
// reply topic llm.responses.TENANT (outside any consumer group). Nothing else: no stage topic, no DLQ.
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class TenantAcls {
    public static void main(String[] args) throws Exception {
        if (args.length != 3 || !args[2].matches("[a-z0-9][a-z0-9_-]{0,47}")) {
            System.err.println("usage: TenantAcls BOOTSTRAP ADMIN_PASSWORD_FILE TENANT < TENANT_PASSWORD (tenant: [a-z0-9_-])");
            System.exit(2);
        }
        String adminPassword = java.nio.file.Files.readString(java.nio.file.Path.of(args[1])).strip();
        String tenantPassword = new java.io.BufferedReader(new java.io.InputStreamReader(System.in)).readLine();
        if (tenantPassword == null || tenantPassword.strip().isEmpty()) {
            System.err.println("the tenant's password goes on standard input");
            System.exit(2);
        }
        tenantPassword = tenantPassword.strip();
        String tenant = args[2];
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        props.put("security.protocol", "SASL_PLAINTEXT");
        props.put("sasl.mechanism", "SCRAM-SHA-256");
        props.put("sasl.jaas.config", "org.apache.kafka.common.security.scram.ScramLoginModule required username=\"admin\" password=\"" + adminPassword + "\";");
        try (Admin admin = Admin.create(props)) {
            ScramCredentialInfo info = new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 8192);
            admin.alterUserScramCredentials(List.of(new UserScramCredentialUpsertion(tenant, info, tenantPassword))).all().get();
            String principal = "User:" + tenant;
            admin.createAcls(List.of(
                allow(principal, "llm.requests", AclOperation.WRITE),
                allow(principal, "llm.requests", AclOperation.DESCRIBE),
                allow(principal, "llm.control", AclOperation.WRITE),
                allow(principal, "llm.control", AclOperation.DESCRIBE),
                allow(principal, "llm.responses." + tenant, AclOperation.READ),
                allow(principal, "llm.responses." + tenant, AclOperation.DESCRIBE)
            )).all().get();
        }
        System.out.println("tenant " + tenant + ": SCRAM user and ACLs in place");
    }

    private static AclBinding allow(String principal, String topic, AclOperation operation) {
        ResourcePattern pattern = new ResourcePattern(ResourceType.TOPIC, topic, PatternType.LITERAL);
        return new AclBinding(pattern, new AccessControlEntry(principal, "*", operation, AclPermissionType.ALLOW));
    }
}
